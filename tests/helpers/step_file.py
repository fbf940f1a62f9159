"""Forging step files for tests: a published step file rewritten with its header edited."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable

from refpipe.pipeline.step_file import HEADER_MEMBER
from refpipe.storage.layout import step_key
from refpipe.storage.store import Store


def forge_header(store: Store, step: int, edit: Callable[[dict], None]) -> None:
    """Rewrite step ``step``'s file with ``edit(header dict)`` applied to its header (its streams unchanged)."""
    src, buf = zipfile.ZipFile(io.BytesIO(store.get(step_key(step)))), io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = src.read(info.filename)
            if info.filename == HEADER_MEMBER:
                header = json.loads(body)
                edit(header)
                body = json.dumps(header).encode()
            dst.writestr(info.filename, body)
    store.put(step_key(step), buf.getvalue())
