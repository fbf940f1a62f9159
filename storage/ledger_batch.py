"""Deletes on a filesystem: one batch record claims a call's chunks, each chunk's commit marker ``unlink`` decides it.

On a filesystem (``Store.claims_by_unlink``) removing a chunk's commit marker is itself exclusive: of any number of
deleters exactly one ``unlink(2)`` of ``zarr.json`` succeeds, the others get ``ENOENT``. So ``Ledger.delete`` (and
``Ledger.release``, which is ``delete`` there) claims the plain chunks of one call with one batch record
(``storage.layout.batch_key``: ``ledger/deletes/releases/batches/<actor>/<session>/<bucket>/<n>.json``, a
``storage.ledger_records.ReleaseRecord`` with ``step`` None, exclusive put) listing them, then per chunk only
unlinks the commit marker (the chunk's claim, ``Store.claim_by_unlink``) and returns; the chunk and its directory are
removed by the ledger's reaper in the background (``storage.ledger_reaper``). A chunk whose marker this call did not
remove is taken off the record again (the record is rewritten once, at the end of the call), so each deleted chunk
is listed by exactly the one record of the call that removed its marker.

Exactly once, case by case:

- a chunk deleted before (by any process, in any earlier call or batch): its marker is gone, so this call removes
  nothing of it; the first deleter is looked up (its delete record, else the batch and release records that list
  it) and the chunk is a double delete naming it (``DoubleDeleteError``), an earlier life of this actor's
  (``already_released``, leftovers removed), or, when nobody claimed it, a delete of an unknown ref;
- two processes racing on one chunk: one ``unlink`` wins; the loser reports the winner as above;
- the same chunk twice in one call: the second is a double delete (``Ledger``);
- a marker ``unlink`` that fails after the retries: the chunk is unresolved and not on the record; it is kept as an
  unfinished delete with a delete record of its own and retried through the per-chunk claim (``Ledger``);
- a marker removed and a later key not (the reaper's removal failed): an unfinished delete this record already
  claims, retried without a claim;
- the deleter dies after the batch record and before the reaper removed every chunk (markers removed or not): the
  record claims present chunks, which the audit lists as unfinished deletes and ``refpipe sweep`` (or the actor's
  next life) removes once. A record that dies listing a chunk another deleter removed (the rewrite not done) is a
  second claim: the audit reports a double delete.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from refpipe.storage.delete_result import DeleteResult, double_delete_error
from refpipe.storage.errors import (
    DeleteRecordError,
    DoubleDeleteError,
    KeyNotFoundError,
    StorageError,
    UnknownRefError,
)
from refpipe.storage.layout import BATCHES_PREFIX, batch_key, tombstone_key
from refpipe.storage.ledger_records import DeleteRecord, ReleaseRecord, read_release_record, release_record_keys

if TYPE_CHECKING:
    from refpipe.storage.ledger import Ledger


class EarlierLife(NamedTuple):
    """A claim of a chunk found written by this actor's earlier session."""

    session: str


class Target(NamedTuple):
    """One chunk to delete: its branch id, node URI, commit-marker key, and every key to remove (marker first)."""

    branch_id: str
    uri: str
    meta_key: str
    keys: list[str]


@dataclass
class Unfinished:
    """A delete this holder started and has not finished: its target, reason and claim record (reused on retry)."""

    target: Target
    reason: str
    record: bytes
    claim: str
    claimed: bool = False
    """The chunk is known claimed by this holder (its delete record written or read back, or its batch removed its
    commit marker)."""


class Batches:
    """One ledger's delete batches on a filesystem (``delete`` per call; numbers ``n`` from 0 per session)."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._lock = threading.Lock()
        self._next = 0

    def delete(self, targets: list[Target], reason: str, result: DeleteResult) -> None:
        """Claim ``targets`` (distinct plain chunks, none an unfinished delete of this ledger) with one batch record
        and their markers' unlinks, and queue the claimed ones' removal (``Reaper.free``: blocks while its backlog is
        full); outcomes go to ``result`` and problems to the ledger's events (``Ledger._note``)."""
        ledger, store = self.ledger, self.ledger.store
        with self._lock:
            key, self._next = batch_key(ledger.actor, ledger.session, self._next), self._next + 1
        record = ReleaseRecord(step=None, holder=ledger.actor, reason=reason, t=round(time.time(), 3),
                               session=ledger.session, claim=uuid.uuid4().hex,
                               branch_ids=sorted(t.branch_id for t in targets))
        started = time.perf_counter()
        try:
            store.put(key, record.model_dump_json().encode(), exclusive=True)
        except StorageError as e:
            for target in targets:
                self._unresolved(target, reason, e, result)
            return
        finally:
            ledger._add_seconds(time.perf_counter() - started)
        removed: list[Target] = []
        refused: list[Target] = []
        for start in range(0, len(targets), _CLAIMS_PER_CALL):  # each slice queued before the next claims: fds
            part, claimed = targets[start:start + _CLAIMS_PER_CALL], []  # held stay bounded (BACKLOG_CHUNKS)
            for target, error in zip(part, store.claim_by_unlink([t.meta_key for t in part])):
                if error is None:
                    claimed.append(target)
                    result.deleted.append(target.uri)
                elif isinstance(error, KeyNotFoundError):
                    refused.append(target)
                else:
                    self._unresolved(target, reason, error, result)
            ledger._reaper.free(claimed, reason, record.claim)
            removed += claimed
        if len(removed) < len(targets):
            self._rewrite(key, record.model_copy(update={"branch_ids": sorted(t.branch_id for t in removed)}))
        for target in refused:
            problem = self._first_claim(target, reason, key)
            ledger._note(target, problem, reason, result)
            if isinstance(problem, EarlierLife):
                ledger._remove([target], result, {target.uri})

    def _unresolved(self, target: Target, reason: str, error: StorageError, result: DeleteResult) -> None:
        """A chunk whose marker this batch did not remove for a store error: an unfinished delete claimed per chunk
        (its own delete record) when retried."""
        ledger = self.ledger
        claim = uuid.uuid4().hex
        record = DeleteRecord(branch_id=target.branch_id, uri=target.uri, holder=ledger.actor, reason=reason,
                              t=round(time.time(), 3), session=ledger.session, claim=claim)
        with ledger._lock:
            ledger._unfinished[target.branch_id] = Unfinished(target, reason, record.model_dump_json().encode(),
                                                               claim)
        result.failed[target.uri] = error

    def _rewrite(self, key: str, record: ReleaseRecord) -> None:
        """Put the record again listing only the chunks this batch removed (a plain put: temp file and rename);
        when the store refuses, the audit reports the chunks it still lists and another deleter removed as double
        deletes (louder, never quieter)."""
        try:
            self.ledger.store.put(key, record.model_dump_json().encode())
        except StorageError as e:
            self.ledger.record("batch_rewrite_failed", uri=self.ledger.store.uri(key), error=str(e))

    def _first_claim(self, target: Target, reason: str, own: str) -> StorageError | EarlierLife:
        """Who removed the commit marker of ``target`` before this batch: ``DoubleDeleteError`` naming them,
        ``EarlierLife`` (this actor's earlier session), or ``UnknownRefError`` (nobody: never kept). Reads the
        chunk's delete record, then the run's batch records other than ``own`` (a double delete is rare: no index
        is kept for it). Several listing it (racing deleters whose calls have not taken it off yet) are read again
        with backoff (``max_retries`` times) until one is left; the first is named."""
        ledger, store = self.ledger, self.ledger.store
        problem = ledger._already_deleted(target, tombstone_key(target.branch_id), reason, None)
        if problem is not None:
            return problem
        candidates = [key for key in release_record_keys(store, BATCHES_PREFIX) if key != own]
        for attempt in range(store.config.max_retries + 1):
            listing: dict[str, ReleaseRecord] = {}
            for key in candidates:
                try:
                    record = read_release_record(store.get(key), store.uri(key))
                except KeyNotFoundError:
                    continue
                except DeleteRecordError as e:
                    return double_delete_error(target.uri, first_holder="?", first_reason=str(e),
                                               second_holder=ledger.actor, reason=reason)
                if target.branch_id in record.branch_ids:
                    listing[key] = record
            if len(listing) <= 1 or attempt == store.config.max_retries:
                break
            candidates = list(listing)
            store.backoff(attempt)
        if listing:
            return _claimed_by(ledger, target, _named_first(ledger, list(listing.values())), reason)
        return UnknownRefError(f"chunk {target.uri}: delete by {ledger.actor} ({reason}) refused: it was never kept "
                               f"(no commit marker, no delete record)")


_CLAIMS_PER_CALL = 128
"""Markers claimed per ``Store.claim_by_unlink`` call; their fds are held until the reaper removes the chunks."""


def _named_first(ledger: Ledger, records: list[ReleaseRecord]) -> ReleaseRecord:
    """Of the records still listing a chunk (a killed deleter's keeps listing chunks it never removed), the one a
    refusal names, in an order independent of listing order: this session's, else another actor's, else this
    actor's earlier life's (an already released chunk: louder, never quieter)."""
    return min(records, key=lambda r: (r.session != ledger.session, r.holder == ledger.actor))


def _claimed_by(ledger: Ledger, target: Target, first: ReleaseRecord, reason: str) -> DoubleDeleteError | EarlierLife:
    if first.holder == ledger.actor and first.session != ledger.session:
        return EarlierLife(first.session)
    return double_delete_error(target.uri, first_holder=first.holder, first_reason=first.reason,
                               second_holder=ledger.actor, reason=reason)


__all__ = ["Batches"]
