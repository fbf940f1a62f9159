"""The reference ledger: per-actor event logs and delete-exactly-once.

Layout under the run prefix:

    ledger/events/<actor>/<seq>.jsonl   an actor's events (keep, discard, double_delete, ...),
                                        one JSON object per line, written as whole segments
    ledger/deletes/<shard>/<branch_id>.json   the delete record of one chunk (its tombstone)

Every actor (env-server worker, orchestrator, trainer DP rank) writes only its
own segments, so there is no shared file to append to and no object to
read-modify-write. The tombstone is the atomic claim: it is written with an
exclusive put (``link(2)`` on a filesystem, ``If-None-Match: *`` on S3), so of
any number of deleters of one chunk exactly one succeeds; the others read the
winner's record and raise ``DoubleDeleteError`` naming both holders, deleting
nothing else.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from storage.chunk import PayloadRef, node_key
from storage.errors import (ChunkNotFoundError, DoubleDeleteError, KeyExistsError, UnknownRefError)
from storage.fetch import chunk_keys
from storage.store import Store

SEGMENT_MAX_EVENTS = 512
SEGMENT_MAX_AGE_S = 2.0


def tombstone_key(branch_id: str) -> str:
    """Key of a chunk's delete record: ``ledger/deletes/<shard>/<branch_id>.json``."""
    return "ledger/deletes/" + node_key(branch_id).removeprefix("payloads/") + ".json"


@dataclass
class DeleteResult:
    """Outcome of one ``Ledger.delete`` call."""

    deleted: list[str] = field(default_factory=list)
    """URIs this call deleted."""
    double_deletes: list[DoubleDeleteError] = field(default_factory=list)
    """Chunks another holder (or this one) had already deleted."""
    unknown: list[UnknownRefError] = field(default_factory=list)
    """Refs that were never kept: no commit marker and no delete record."""


class Ledger:
    """One actor's view of the ledger.

    Every process creates its own ``Ledger`` with a unique ``actor`` name
    (``env_worker_3``, ``orchestrator``, ``trainer_dp0``) and calls ``close`` at a
    clean shutdown, which flushes its events and writes a ``close`` event.

    Args:
        store: the run's store.
        actor: who this is; names the holder in delete records and errors.
    """

    def __init__(self, store: Store, actor: str):
        self.store = store
        self.actor = actor
        self._events: list[dict] = []
        self._seq = 0
        self._flushed_at = time.monotonic()
        self._lock = threading.Lock()
        self._session = f"{os.getpid()}-{int(time.time() * 1000)}"
        self.record("open")

    def record(self, event: str, **fields) -> None:
        """Append an event to this actor's log; flushed as a segment every 512 events or 2 s."""
        with self._lock:
            self._events.append({"event": event, "actor": self.actor, "t": round(time.time(), 3), **fields})
            due = len(self._events) >= SEGMENT_MAX_EVENTS or time.monotonic() - self._flushed_at > SEGMENT_MAX_AGE_S
        if due:
            self.flush()

    def flush(self) -> None:
        """Write buffered events as one new segment object (atomic put)."""
        with self._lock:
            events, self._events = self._events, []
            seq, self._seq = self._seq, self._seq + 1
            self._flushed_at = time.monotonic()
        if events:
            body = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events).encode()
            self.store.put(f"ledger/events/{self.actor}/{self._session}-{seq:06d}.jsonl", body, exclusive=True)

    def close(self) -> None:
        """Record a clean end of this actor and flush."""
        self.record("close")
        self.flush()

    def record_keep(self, ref: PayloadRef) -> None:
        """Record that this actor kept ``ref`` (it holds it until it hands the ref on)."""
        self.record("keep", branch_id=ref.branch_id, uri=ref.uri, nbytes=ref.nbytes)

    def delete(self, refs: Sequence[PayloadRef], *, reason: str, max_concurrency: int = 8) -> DeleteResult:
        """Delete chunks exactly once, recording who deleted each and why.

        All refs are confinement-checked before any I/O. For each ref: check the commit
        marker, claim with an exclusive put of the delete record, then delete the chunk's
        objects (S3: batched ``DeleteObjects``).

        Raises:
            OutsideRunError: a ref points outside the run prefix (nothing deleted).
            DoubleDeleteError: some chunks were already deleted; every other chunk was
                deleted. ``.result`` holds the full ``DeleteResult``.
            UnknownRefError: some refs were never kept (and none double-deleted); ``.result`` as above.
        """
        keys = [chunk_keys(self.store, ref) for ref in refs]
        result = DeleteResult()
        with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(refs)))) as pool:
            claims = list(pool.map(lambda ref: self._claim(ref, reason), refs))
        doomed: list[str] = []
        for ref, (data_key, meta_key), problem in zip(refs, keys, claims):
            if problem is None:
                doomed += [meta_key, data_key]
                result.deleted.append(ref.uri)
            elif isinstance(problem, DoubleDeleteError):
                result.double_deletes.append(problem)
                self.record("double_delete", branch_id=ref.branch_id, reason=reason, first=problem.first_holder)
            else:
                result.unknown.append(problem)
                self.record("unknown_delete", branch_id=ref.branch_id, uri=ref.uri, reason=reason)
        self.store.delete(doomed)
        self._raise_problems(result)
        return result

    def _claim(self, ref: PayloadRef, reason: str) -> DoubleDeleteError | UnknownRefError | None:
        _, meta_key = chunk_keys(self.store, ref)
        tomb = tombstone_key(ref.branch_id)
        if not self.store.exists(meta_key):
            return self._already_deleted(ref, tomb, reason) or UnknownRefError(
                f"chunk {ref.uri}: delete by {self.actor} ({reason}) refused: it was never kept "
                f"(no commit marker, no delete record)")
        record = {"branch_id": ref.branch_id, "uri": ref.uri, "holder": self.actor, "reason": reason,
                  "t": round(time.time(), 3)}
        try:
            self.store.put(tomb, json.dumps(record).encode(), exclusive=True)
        except KeyExistsError:
            return self._already_deleted(ref, tomb, reason)
        return None

    def _already_deleted(self, ref: PayloadRef, tomb: str, reason: str) -> DoubleDeleteError | None:
        try:
            first = json.loads(self.store.get(tomb))
        except ChunkNotFoundError:
            return None
        except ValueError:
            first = {"holder": "?", "reason": "unreadable delete record"}
        err = DoubleDeleteError(
            f"chunk {ref.uri} was already deleted by {first.get('holder')} ({first.get('reason')}); "
            f"second delete from {self.actor} ({reason})")
        err.first_holder, err.second_holder = first.get("holder"), self.actor
        return err

    @staticmethod
    def _raise_problems(result: DeleteResult) -> None:
        problems = result.double_deletes or result.unknown
        if not problems:
            return
        err = type(problems[0])(
            f"{len(result.double_deletes)} double deletes, {len(result.unknown)} deletes of unknown refs "
            f"({len(result.deleted)} other chunks deleted); first: {problems[0]}")
        err.result = result
        raise err
