"""Each kind of concurrent work reads its own ``StorageConfig`` knob: the scans of the audit and of the CLI's walks
run on ``max_concurrent_scan_ops`` threads, whatever ``max_concurrent_fetches`` (a trainer rank's fetches) says."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from refpipe.cli.inspect_common import parallel_map
from refpipe.pipeline.audit_scan import _parallel
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.store import Store

KEYS = [f"steps/{i:06d}.zip" for i in range(4)]


def _widest(run: Callable[[Store, Callable[[str], bool], Sequence[str]], list[bool]], store: Store) -> int:
    """Most calls of ``store.exists`` in flight at once under ``run``; each call holds its thread until a third
    call is in flight or 0.5 s passed, so a limit above two shows as three or more."""
    cond, active, widest = threading.Condition(), [0], [0]

    def exists(key: str) -> bool:
        with cond:
            active[0] += 1
            widest[0] = max(widest[0], active[0])
            cond.notify_all()
            cond.wait_for(lambda: active[0] >= 3, timeout=0.5)
        try:
            return store.exists(key)
        finally:
            with cond:
                active[0] -= 1

    assert run(store, exists, KEYS) == [False] * len(KEYS)
    return widest[0]


@pytest.mark.parametrize("run", [
    lambda store, fn, items: parallel_map(store, fn, items, "checking"),
    lambda store, fn, items: _parallel(store, fn, items, None, "checking"),
], ids=["cli_parallel_map", "audit_scan"])
def test_scans_run_on_max_concurrent_scan_ops_threads(tmp_path, run):
    store = open_store(StorageConfig(root=str(tmp_path), max_concurrent_fetches=8, max_concurrent_scan_ops=2))
    assert _widest(run, store) == 2
