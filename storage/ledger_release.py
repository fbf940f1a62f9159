"""Releases on S3: one exclusive claim for a DP rank's chunks of one step, then batched deletes.

On S3 every exclusive put is a round trip that costs about as much as deleting a few keys in a ``DeleteObjects``
batch, and checking a commit marker is another; one of each per chunk made a release 3.5-6x the raw batched
delete of the same objects. So ``Ledger.release`` on S3 (``Store.claims_per_release``) writes one release record
(``ledger/deletes/releases/step_<N:08d>/<actor>.json``, ``storage.ledger_records.ReleaseRecord``, exclusive put)
listing the chunks, then deletes their objects with ``Store.delete_keys`` (``DeleteObjects``, 1,000 keys a request,
every key's result checked).

Exactly once, case by case:

- the same release again (same actor and step, same session: a second release of the batch): it meets the first
  record, and every chunk that record lists is a double delete (``DoubleDeleteError`` naming the first holder);
  nothing is deleted;
- a restarted actor releasing a step its earlier life released: ``already_released``, the leftovers removed;
- a ref the record does not list (a later release of the same step with other refs) goes through
  ``Ledger.delete`` (its own delete record);
- a chunk claimed twice by different records (a ref published in two steps; released and also deleted by the
  orchestrator or the sweep): neither claim sees the other at delete time -- that is the per-chunk round trip a
  release saves -- so the audit reads every release record (one ``get`` per DP rank and step, not per chunk) and
  reports a chunk that two records claim as a double delete (``pipeline.audit_scan``). ``Ledger.delete`` of a
  chunk a release already deleted finds neither its commit marker nor a delete record of its own: refused as a
  delete of an unknown ref (``UnknownRefError``, recorded, nothing deleted). A fetch of the chunk after its
  first delete, given its step, is ``ChunkNotFoundError`` naming the first deleter;
- a claimed chunk whose objects could not all be deleted (a store error, or the releaser died) is an unfinished
  delete: retried with the same claim by the next release of the step, ``finish_unfinished`` and ``close``; after a
  crash the audit lists it (a record claims it, objects remain) and ``refpipe sweep`` removes the leftovers once.

A release checks no commit marker (the second per-chunk round trip): its refs are a step file's, whose chunks were
kept when the step was published and fetched by the releasing rank.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.delete_result import DeleteResult, double_delete_error
from refpipe.storage.errors import (
    DeleteKeysError,
    DeleteRecordError,
    DoubleDeleteError,
    KeyExistsError,
    KeyNotFoundError,
    StorageError,
    UnknownRefError,
)
from refpipe.storage.layout import chunk_keys, release_key
from refpipe.storage.ledger_records import ReleaseRecord, read_release_record

if TYPE_CHECKING:
    from refpipe.storage.ledger import Ledger


@dataclass
class _Release:
    """A release this actor claimed (or tried to): its record and the chunks whose objects are not yet deleted."""

    step: int
    reason: str
    record: bytes
    claim: str
    refs: dict[str, PayloadRef]
    """Branch id -> ref of every chunk the record lists."""
    left: set[str] = field(default_factory=set)
    """Branch ids whose objects are not known deleted."""
    claimed: bool = False


class Releases:
    """One ledger's release claims (S3): ``release`` per (step, batch), the unfinished ones kept for a retry."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self._pending: dict[str, _Release] = {}

    def unfinished(self) -> list[str]:
        """URIs of the chunks of this ledger's unfinished releases."""
        with self.ledger._lock:
            pending = list(self._pending.values())
        return [self._uri(ref) for p in pending for b, ref in p.refs.items() if b in p.left]

    def finish(self, result: DeleteResult) -> None:
        """Retry every unfinished release with its own claim, adding the outcomes to ``result``."""
        with self.ledger._lock:
            pending = list(self._pending.values())
        for p in pending:
            part = self.release(p.step, [ref for b, ref in p.refs.items() if b in p.left], p.reason)
            result.deleted += part.deleted
            result.failed.update(part.failed)

    def release(self, step: int, refs: list[PayloadRef], reason: str) -> DeleteResult:
        """See ``Ledger.release``; problems are in the result (the ledger raises them).

        Raises:
            OutsideRunError: a ref's URI names another chunk than its branch id (before any I/O).
        """
        result = DeleteResult()
        batch: dict[str, PayloadRef] = {}
        per_chunk: list[PayloadRef] = []
        for ref in refs:
            ref.key  # noqa: B018 - OutsideRunError before any I/O
            if ref.segments or ref.holders:  # a segmented branch, a shared prefix: claimed per chunk (holders counted)
                per_chunk.append(ref)
                continue
            if ref.branch_id in batch:  # the same chunk twice in one call: the second is a double delete
                self._double(ref, self.ledger.actor, reason, f"{reason}, earlier in this call", result)
            batch.setdefault(ref.branch_id, ref)
        covered: set[str] = set()
        if batch:  # none: no record (a retained step's release deletes nothing)
            covered = self._claim_and_remove(step, batch, reason, result)
        others = [r for b, r in batch.items() if b not in covered and self._uri(r) not in result.failed] + per_chunk
        if others:
            self._delete_others(others, reason, result)
        return result

    def _claim_and_remove(self, step: int, batch: dict[str, PayloadRef], reason: str,
                          result: DeleteResult) -> set[str]:
        """Claim ``batch`` with the step's release record and delete what it covers; returns the covered ids."""
        started = time.perf_counter()
        release, covered = self._claim(step, batch, reason, result)
        self.ledger._add_seconds(time.perf_counter() - started)
        if release is not None and covered:
            self._remove(release, covered, result)
        for b, ref in batch.items():
            if (uri := self._uri(ref)) in result.failed:
                self.ledger.record("unfinished_delete", branch_id=b, uri=uri, reason=reason,
                                   error=str(result.failed[uri]))
        return covered

    def _uri(self, ref: PayloadRef) -> str:
        """The chunk's URI in the run as opened (what ``DeleteResult`` is keyed by)."""
        return self.ledger.store.uri(ref.key)

    def _claim(self, step: int, batch: dict[str, PayloadRef], reason: str,
               result: DeleteResult) -> tuple[_Release | None, set[str]]:
        """The release covering ``batch`` (this actor's claim of step ``step``) and the branch ids of ``batch`` it
        lists and this call deletes; double deletes and store errors go to ``result``."""
        key = release_key(step, self.ledger.actor)
        with self.ledger._lock:
            release = self._pending.get(key)
        if release is None:
            claim = uuid.uuid4().hex
            record = ReleaseRecord(step=step, holder=self.ledger.actor, reason=reason, t=round(time.time(), 3),
                                   session=self.ledger.session, claim=claim, branch_ids=sorted(batch))
            release = _Release(step, reason, record.model_dump_json().encode(), claim, dict(batch), set(batch))
        if release.claimed:
            return release, set(batch) & set(release.refs)
        store = self.ledger.store
        try:
            store.put(key, release.record, exclusive=True)
        except KeyExistsError:
            return self._existing(key, release, batch, reason, result)
        except StorageError as e:
            return self._unresolved(key, release, batch, e, result)
        release.claimed = True
        with self.ledger._lock:
            self._pending[key] = release
        return release, set(batch) & set(release.refs)

    def _unresolved(self, key: str, release: _Release, batch: dict[str, PayloadRef], error: StorageError,
                    result: DeleteResult) -> tuple[None, set[str]]:
        """The claim is unresolved (a store error after the store's retries): its chunks failed; the release is
        kept to be retried with this claim."""
        with self.ledger._lock:
            self._pending[key] = release
        result.failed.update((self._uri(ref), error) for b, ref in batch.items() if b in release.refs)
        return None, set()

    def _existing(self, key: str, release: _Release, batch: dict[str, PayloadRef], reason: str,
                  result: DeleteResult) -> tuple[_Release | None, set[str]]:
        """The claim put met a record at ``key``: this actor's earlier life (already released: finish it), or a
        second release of the batch (every chunk it lists is a double delete, nothing deleted)."""
        store = self.ledger.store
        try:
            first = read_release_record(store.get(key), store.uri(key))
        except (DeleteRecordError, KeyNotFoundError) as e:  # unreadable, or gone: claimed by someone unknown
            for ref in batch.values():
                self._double(ref, "?", reason, str(e) or "release record vanished", result)
            return None, set(batch)
        except StorageError as e:  # unresolved: retried with this claim
            return self._unresolved(key, release, batch, e, result)
        listed = set(batch) & set(first.branch_ids)
        if first.claim == release.claim:
            release.claimed = True
            with self.ledger._lock:
                self._pending[key] = release
            return release, listed
        if first.session != self.ledger.session:  # the key names this actor: its earlier life
            refs = {b: ref for b, ref in batch.items() if b in listed}  # in the call's order
            for b, ref in refs.items():
                self.ledger.record("already_released", branch_id=b, uri=self._uri(ref), reason=reason,
                                   first_session=first.session)
            earlier = _Release(release.step, first.reason, b"", first.claim, refs, set(listed), claimed=True)
            self._remove(earlier, listed, result, already=True)
            return None, listed
        for b, ref in batch.items():
            if b in listed:
                self._double(ref, first.holder, reason, first.reason, result)
        return None, listed

    def _remove(self, release: _Release, covered: set[str], result: DeleteResult, already: bool = False) -> None:
        """Delete the objects of ``covered`` (claimed by ``release``) in batches; a chunk with a key the store could
        not delete stays in ``release.left`` (unfinished)."""
        keys = {b: list(chunk_keys(ref.key))[::-1] for b, ref in release.refs.items() if b in covered}  # marker first
        failed: dict[str, StorageError] = {}
        try:
            self.ledger.store.delete_keys([k for ks in keys.values() for k in ks])
        except DeleteKeysError as e:
            failed = e.failed
        except StorageError as e:
            failed = {k: e for ks in keys.values() for k in ks}
        for b, ks in keys.items():
            error = next((failed[k] for k in ks if k in failed), None)
            uri = self._uri(release.refs[b])
            if error is not None:
                result.failed[uri] = error
                continue
            (result.already_released if already else result.deleted).append(uri)
            release.left.discard(b)
        if not already and not release.left:
            with self.ledger._lock:
                self._pending.pop(release_key(release.step, self.ledger.actor), None)

    def _delete_others(self, refs: list[PayloadRef], reason: str, result: DeleteResult) -> None:
        """Refs the release record does not list: each claimed by its own delete record (``Ledger.delete``)."""
        try:
            part = self.ledger.delete(refs, reason=reason)
        except (DoubleDeleteError, UnknownRefError) as e:
            assert e.result is not None  # Ledger.delete raises these with the call's result
            part = e.result
        result.merge(part)

    def _double(self, ref: PayloadRef, first_holder: str, reason: str, first_reason: str,
                result: DeleteResult) -> None:
        uri = self._uri(ref)
        result.double_deletes[uri] = double_delete_error(uri, first_holder=first_holder, first_reason=first_reason,
                                                         second_holder=self.ledger.actor, reason=reason)
        self.ledger.record("double_delete", branch_id=ref.branch_id, uri=uri, reason=reason, first=first_holder,
                           first_reason=first_reason)
