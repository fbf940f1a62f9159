"""Freeing claimed chunks' bytes off the deleter's path on a filesystem: ``Reaper``, one background thread per ledger.

On a filesystem (``Store.claims_by_unlink``) what decides a delete is done when ``Ledger.delete`` returns: the batch
record and each chunk's commit-marker ``unlink`` (its claim, ``storage.ledger_batch``; the marker's inode held open,
``local_dirs.HeldInodes``). What is left decides nothing: closing the held marker (ext4 frees its inode), unlinking
the chunk (``c.0``; ext4 frees its blocks and page cache, about 0.5 ms for 1.5 MiB) and removing its directory.
``Ledger.delete`` hands those to the ledger's reaper, a daemon thread started when chunks are queued, and returns;
the reaper removes what is queued in batches of up to ``_BATCH_CHUNKS`` chunks (``Store.delete_keys``: directories
in parallel) and ends when none is left.
``Ledger.wait_freed`` waits until the backlog is removed; ``Ledger.close`` does so before the session closes.

Crash: a backlog lost with the process (SIGKILL, power loss) leaves chunks whose commit marker is gone and whose
``c.0`` remains, listed by the batch record that claims them: the state a deleter killed between its claim and its
unlinks leaves, which the audit lists as unfinished deletes and ``refpipe sweep`` or the actor's next life
(``already_released``) finish once. Failure: a removal that fails after the store's retries makes the chunk an
unfinished delete of the ledger, already claimed (``Ledger.finish_unfinished`` and ``close`` retry it without a
claim), recorded as an ``unfinished_delete`` event and logged; never dropped.
"""

from __future__ import annotations

import logging
import queue
import resource
import threading
from typing import TYPE_CHECKING, NamedTuple

from refpipe.storage.errors import DeleteKeysError
from refpipe.storage.ledger_batch import Target, Unfinished

if TYPE_CHECKING:
    from refpipe.storage.ledger import Ledger

log = logging.getLogger(__name__)

BACKLOG_CHUNKS = min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8)
"""Claimed chunks queued for removal at most; a delete that would queue more waits until there is room, so the bytes
of deleted chunks still on disk stay bounded (1,024 chunks: 1.5 GiB of 1.5 MiB routing chunks, about half a second of
removals at the ~2,000 ``os.remove`` of such chunks per second measured here), while a step's release of up to a
thousand chunks returns without waiting. Each queued chunk holds its claimed marker's fd (``local_dirs.HeldInodes``),
so at most an eighth of this process's fd limit (as ``local_confined``'s directory handles)."""
_BATCH_CHUNKS = 64
"""Chunks the reaper removes per ``Store.delete_keys`` call (their directories in parallel)."""


class _Claimed(NamedTuple):
    """A chunk whose commit marker a batch removed: its target, the delete's reason and the batch record's claim."""

    target: Target
    reason: str
    claim: str


class Reaper:
    """The background removal of one ledger's claimed chunks (thread-safe; any thread of the actor calls it).

    Its thread runs while chunks are queued and ends when the backlog is empty (the next ``free`` starts another), so
    an idle ledger holds no thread and a ledger dropped without ``close`` is collected once its backlog is removed.
    """

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._queue: queue.Queue[_Claimed] = queue.Queue(BACKLOG_CHUNKS)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def free(self, targets: list[Target], reason: str, claim: str) -> None:
        """Queue the keys after the commit marker (``Target.keys[1:]``) of chunks ``targets`` (claimed by the batch
        record with ``claim``) for removal; blocks while the backlog is full (``BACKLOG_CHUNKS``)."""
        for target in targets:
            self._queue.put(_Claimed(target, reason, claim))
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"refpipe-reaper-{self.ledger.actor}")
                    self._thread.start()

    def wait(self) -> None:
        """Return once every chunk queued so far is removed (or an unfinished delete of the ledger)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._queue.empty():  # the only consumer: not empty means the gets below succeed
                    self._thread = None
                    return
            batch = [self._queue.get_nowait()]
            while len(batch) < _BATCH_CHUNKS and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                self._remove(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _remove(self, chunks: list[_Claimed]) -> None:
        """Delete the chunks' remaining keys; each chunk with a key left is an unfinished delete of the ledger."""
        keys = [key for c in chunks for key in c.target.keys[1:]]
        failed: dict[str, Exception] = {}
        try:
            self.ledger.store.delete_keys(keys)
        except DeleteKeysError as e:
            failed = dict(e.failed)
        except Exception as e:  # noqa: BLE001 -- the reaper never dies: every chunk of the batch stays unfinished
            failed = dict.fromkeys(keys, e)
        for chunk in chunks:
            error = next((failed[k] for k in chunk.target.keys[1:] if k in failed), None)
            if error is not None:
                self._unfinished(chunk, error)
        if failed:
            self.ledger._flush_now()

    def _unfinished(self, chunk: _Claimed, error: Exception) -> None:
        ledger, target = self.ledger, chunk.target
        with ledger._lock:
            ledger._unfinished[target.branch_id] = Unfinished(target, chunk.reason, b"", chunk.claim, True)
        ledger.record("unfinished_delete", branch_id=target.branch_id, uri=target.uri, reason=chunk.reason,
                      error=str(error))
        log.warning("ledger %s: chunk %s is deleted (claimed) but its bytes could not be removed: %s; this ledger "
                    "retries at finish_unfinished and close, else `refpipe sweep` removes them", ledger.actor,
                    target.uri, error)


__all__ = ["BACKLOG_CHUNKS", "Reaper"]
