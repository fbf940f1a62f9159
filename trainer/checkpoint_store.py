"""torch.distributed.checkpoint (DCP) on a refpipe ``Store``: every checkpoint byte goes through ``Store.put`` and
``Store.get``, so checkpoints get the store's error classification, its one retry layer, write tokens and the
run-prefix confinement, on a directory and on S3 alike (docs/DESIGN.md, "Store errors").

DCP's ``FileSystemWriter`` and ``FileSystemReader`` do all their I/O through a ``FileSystemBase``;
``StoreFileSystem`` is one whose paths are store keys (``checkpoints/step_<N:08d>/<file>``):

- a file DCP writes is held in memory and, when DCP closes it, written with one exclusive, durable put
  (``Store.put(exclusive=True, durable=True)``): readers never see a part of it, and a put whose answer was
  lost is recognised by its write token. A rank's share is therefore held in memory whole until its put.
- DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it into place; the temp file's bytes stay in
  memory and the rename is the exclusive put of ``.metadata``: it appears at once and is never replaced.
- a file DCP reads is one ``Store.get`` of the whole object (DCP reads all it needs of a file in one pass); a
  404 is read again like a chunk a reference names (bounded, ``Store.retrying``): the checkpoint was listed
  complete, so a stale cache or a lagging replica may not show the file yet.

Before any rank writes, DCP's coordinator (rank 0, in ``prepare_global_plan``; DCP hands its error to every
rank) deletes what an earlier life of the run left of this checkpoint when it died mid-write (no commit
marker): every put of the new write is exclusive, and resume skipped that checkpoint anyway.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter

from refpipe.storage.errors import KeyExistsError, KeyNotFoundError
from refpipe.storage.layout import CHECKPOINT_MARKER_NAME, CHECKPOINTS_PREFIX
from refpipe.storage.store import Store

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import SavePlan

log = logging.getLogger(__name__)
_TEMP_SUFFIX = ".tmp"
"""DCP writes ``.metadata`` under this suffix, then renames it (``_FileSystemWriter.finish``, torch 2.13)."""


class _PutOnClose(io.BytesIO):
    """A file DCP writes: its bytes are handed to ``written`` once, when DCP closes it."""

    def __init__(self, written: Callable[[bytes], None]):
        super().__init__()
        self._written: Callable[[bytes], None] | None = written

    def close(self) -> None:
        written, self._written = self._written, None
        if written is not None and not self.closed:
            # CPython's getvalue() hands over the buffer itself, not a copy; unlike a getbuffer() view it leaves
            # no export on the stream, which a failed put's traceback would keep alive past close()
            written(self.getvalue())
        super().close()

    def abandon(self) -> None:
        """Close without writing (DCP failed while writing the file)."""
        self._written = None
        self.close()


class StoreFileSystem(FileSystemBase):
    """DCP's file operations on ``store``; paths are store keys. One per ``StoreWriter`` or ``StoreReader`` (the temp
    files it holds are that writer's)."""

    def __init__(self, store: Store):
        self.store = store
        self._held: dict[str, bytes] = {}  # temp files DCP will rename: their bytes until the rename

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        key = str(path)
        if "r" in mode:
            get = lambda: self.store.get(key)  # noqa: E731
            yield io.BytesIO(self.store.retrying(f"read {self.store.uri(key)}", get, retry=KeyNotFoundError))
            return
        stream = _PutOnClose(lambda data: self._written(key, data))
        try:
            yield stream
        except BaseException:
            stream.abandon()
            raise
        stream.close()  # DCP closes its share files itself, not ``.metadata.tmp``

    def _written(self, key: str, data: bytes) -> None:
        if key.endswith(_TEMP_SUFFIX):
            self._held[key] = data
        else:
            self.store.put(key, data, exclusive=True, durable=True)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """The exclusive, durable put of a held temp file's bytes at ``new_path``."""
        self.store.put(str(new_path), self._held.pop(str(path)), exclusive=True, durable=True)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Nothing: a put makes what its key needs."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith(f"{CHECKPOINTS_PREFIX}/")

    def exists(self, path: str | os.PathLike) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        """Never: a checkpoint's files are written once (DCP removes a ``.metadata`` it finds before its rename).

        Raises:
            KeyExistsError: always, naming the file.
        """
        raise KeyExistsError(f"{self.store.uri(str(path))} already exists: a checkpoint's files are written once")

    def clear_unpublished(self, key: str) -> None:
        """Delete what an earlier, dead writer left under checkpoint ``key`` (it has no commit marker).

        Raises:
            KeyExistsError: checkpoint ``key`` is published (has its commit marker); nothing deleted.
            StorageError: the listing or a delete failed.
        """
        keys = self.store.list_prefix(key)
        if f"{key}/{CHECKPOINT_MARKER_NAME}" in keys:
            raise KeyExistsError(f"checkpoint {self.store.uri(key)} is already published: not written again")
        if keys:
            log.warning("checkpoint %s: deleting %d files of an unpublished earlier write before writing it",
                        self.store.uri(key), len(keys))
            self.store.delete_keys(keys)


class StoreWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` on ``StoreFileSystem``: writes checkpoint ``key`` (one file per rank).

    Every rank makes one and hands it to ``dcp.save``. DCP's files are not fsynced by DCP (``sync_files=False``):
    each is a durable put. The coordinator clears an unpublished earlier write of ``key`` before any rank writes.
    """

    def __init__(self, store: Store, key: str):
        super().__init__(key, sync_files=False)
        self.fs = StoreFileSystem(store)  # type: ignore[assignment]  # torch annotates fs as its own FileSystem;
        # the writer only calls FileSystemBase's methods, which StoreFileSystem implements
        self.path = key

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """No directory to make and no overwrite check on a rank: the coordinator's ``prepare_global_plan`` owns
        what is already under ``key``."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        cast(StoreFileSystem, self.fs).clear_unpublished(str(self.path))  # both set in __init__
        return super().prepare_global_plan(plans)


class StoreReader(FileSystemReader):
    """DCP's ``FileSystemReader`` on ``StoreFileSystem``: reads checkpoint ``key``; every rank hands one to
    ``dcp.load``."""

    def __init__(self, store: Store, key: str):
        super().__init__(key)
        self.fs = StoreFileSystem(store)  # type: ignore[assignment]  # as in StoreWriter
        self.path = key
