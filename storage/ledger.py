"""The reference ledger's deletes: exactly once, recorded, resumable after a store error.

``Ledger`` is one actor's ledger session (``storage.ledger_session``: open, events, heartbeat, close) plus its
deletes. Keeps are recorded twice: by the chunk itself (``zarr.json`` names the writer) and by a buffered ``keep``
event; ships and borrows by the step file; deletes by the chunk's delete record
(``ledger/deletes/<aa>/<bb>/<branch_id>.json``, a ``storage.ledger_records.DeleteRecord``).

The delete record is the atomic claim: it is written with an exclusive put (``link(2)`` on a filesystem,
``If-None-Match: *`` on S3), so of any number of deleters of one chunk exactly one succeeds; the others read the
winner's record, record a ``double_delete`` event and raise ``DoubleDeleteError`` naming both holders, deleting
nothing else. On a filesystem one batch record claims a call's plain chunks and each chunk's commit marker
``unlink`` decides it (``storage.ledger_batch``), the bytes removed in the background (``storage.ledger_reaper``);
on S3 a trainer's release claims a DP rank's chunks of a step with one release record (``storage.ledger_release``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.delete_result import DeleteResult, double_delete_error, raise_problems
from refpipe.storage.errors import (
    DeleteKeysError,
    DeleteRecordError,
    DoubleDeleteError,
    KeyExistsError,
    KeyNotFoundError,
    StorageError,
    UnknownRefError,
    expect_each,
)
from refpipe.storage.layout import branch_id_of, chunk_keys, meta_key, tombstone_key
from refpipe.storage.ledger_batch import Batches, EarlierLife, Target, Unfinished
from refpipe.storage.ledger_holds import release_holds
from refpipe.storage.ledger_reaper import Reaper
from refpipe.storage.ledger_records import DeleteRecord, read_delete_record
from refpipe.storage.ledger_release import Releases
from refpipe.storage.ledger_session import LedgerSession
from refpipe.storage.store import Store

log = logging.getLogger(__name__)


def _target(store: Store, chunk: PayloadRef) -> Target:
    data_key, meta_key = chunk_keys(chunk.key)
    return Target(chunk.branch_id, store.uri(chunk.key), meta_key, [meta_key, data_key])


class Ledger(LedgerSession):
    """One actor's session of the ledger, with its exactly-once deletes.

    Every process creates one ``Ledger`` per actor it plays, with a unique ``actor`` name (``env_worker_3``,
    ``orchestrator``, ``trainer_dp0``), after any fork, and calls ``close`` at a clean shutdown. Construction opens
    the session (``LedgerSession``: one put of the ``open`` event, one refused put that probes exclusivity, the
    heartbeat). Events are buffered as ``LedgerSession`` says, and also flushed right after a delete that found a
    problem. On a filesystem a background thread removes deleted chunks' bytes (``storage.ledger_reaper``).

    Args:
        store: the run's store.
        actor: who this is (1-128 of ``[A-Za-z0-9._-]``); names the holder in delete records and errors.

    Raises:
        As ``LedgerSession``.
    """

    def __init__(self, store: Store, actor: str):
        self._unfinished: dict[str, Unfinished] = {}
        self._releases = Releases(self)
        self._batches = Batches(self)
        self._reaper = Reaper(self)
        super().__init__(store, actor)

    def close(self) -> None:
        """Wait until the bytes of every deleted chunk are removed (``wait_freed``), retry unfinished deletes once
        more, record a clean end of this session and flush; the last heartbeat says closed.

        What is still unfinished is left to ``refpipe sweep`` (the delete records exist, or the chunks are leaked
        and claimed there). A second call does nothing.
        """
        if self.closed:
            return
        self._reaper.wait()
        if self.unfinished:
            try:
                self.finish_unfinished()
            except (DoubleDeleteError, UnknownRefError):
                pass  # recorded as events; the audit reports them
        super().close()

    def wait_freed(self) -> None:
        """Return once every chunk this ledger's deletes claimed so far is removed (a filesystem's background removal,
        ``storage.ledger_reaper``; elsewhere at once), a failed removal then in ``unfinished``; any thread calls it."""
        self._reaper.wait()

    def delete(self, refs: Sequence[PayloadRef], *, reason: str, max_concurrency: int = 8) -> DeleteResult:
        """Delete chunks exactly once, recording who deleted each and why.

        Each ref's chunk is the one its branch id names in this run (``PayloadRef.key``, checked against its URI
        before any I/O); a segmented branch's chunks are its segments (``PayloadRef.chunks``), each an outcome. On
        a filesystem (``Store.claims_by_unlink``): one batch record claims the call's chunks (one exclusive put),
        then per chunk, one after another, the ``unlink`` of its commit marker (``zarr.json``; of concurrent deleters
        exactly one succeeds: the chunk's claim) (``storage.ledger_batch``); the chunk (``c.0``) and its directory
        are removed after the call returns, by this ledger's background reaper (``storage.ledger_reaper``: a bounded
        backlog, this call waits while it is full; ``wait_freed`` and ``close`` wait until it is removed).
        Elsewhere, for each ref, in parallel: check the commit marker, claim with an exclusive put of the chunk's
        delete record; then the claimed chunks' objects are deleted (S3: batched ``DeleteObjects``), commit marker
        first, before the call returns. A fetch after the bytes are removed is ``ChunkNotFoundError``.

        A store error that outlasts the store's retries never raises: that ref's outcome is ``failed``
        (``DeleteResult.failed``; the reaper's failures come after the call returned ``deleted``), recorded as an
        ``unfinished_delete`` event and kept by this ledger with its claim; ``delete`` of the same ref again,
        ``finish_unfinished`` and ``close`` finish it with that claim (never a double delete of its own), and
        ``refpipe sweep`` at the latest (the audit lists a claimed chunk still present as unfinished).

        Args:
            refs: chunks to delete.
            reason: why (the deletion path); stored in the delete record.
            max_concurrency: threads claiming at once.

        Raises:
            ArgumentTypeError: ``refs`` is not a sequence of ``PayloadRef`` (nothing deleted).
            OutsideRunError: a ref's URI names another chunk than its branch id (nothing deleted).
            DoubleDeleteError: some chunks were already deleted; every other chunk was deleted. ``.result`` holds
                the full ``DeleteResult``.
            UnknownRefError: some refs were never kept (and none double-deleted); ``.result`` as above.
            LedgerClosedError: this session was closed (nothing deleted).
        """
        refs = expect_each(refs, PayloadRef, "Ledger.delete(refs)")
        return self.release_chunks([(c, ref.branch_id) for ref in refs for c in ref.chunks], reason=reason,
                                   max_concurrency=max_concurrency)

    def release_chunks(self, chunks: Sequence[tuple[PayloadRef, str]], *, reason: str,
                       max_concurrency: int = 8) -> DeleteResult:
        """``delete`` of chunks, each with the branch releasing it: a shared prefix (``PayloadRef.holders``) records
        that branch's release, deleted after its last holder's (``storage.ledger_holds``). Raises as ``delete``."""
        self.check_open(f"delete ({reason})")
        targets = [_target(self.store, c) for c, _ in chunks if not c.holders or c.key]  # keys before any I/O
        doomed, held = release_holds(self.store, [(c, b) for c, b in chunks if c.holders], actor=self.actor,
                                     reason=reason)
        return self._delete_targets([t for (c, _), t in zip(chunks, targets) if not c.holders]
                                    + [_target(self.store, c) for c in doomed], reason, max_concurrency,
                                    [(_target(self.store, c), e) for c, e in held], batch=self.store.claims_by_unlink)

    def release(self, step: int, refs: Sequence[PayloadRef], *, reason: str, max_concurrency: int = 8) -> DeleteResult:
        """``delete`` of a DP rank's owned chunks of step ``step`` (the trainer's release; called once per step by
        the rank's actor): on a store whose claims are round trips (``Store.claims_per_release``: S3) one release
        record claims them all and they are deleted in batches (``storage.ledger_release``); elsewhere ``delete``
        (a filesystem: one batch record).

        Args:
            step: the step whose chunks these are (names the release record: one per actor and step).
            refs: the chunks (a step file's refs this DP rank owns).
            reason: why (stored in the record).
            max_concurrency: threads claiming at once (per-chunk claims only).

        Raises:
            As ``delete``.
        """
        refs = expect_each(refs, PayloadRef, "Ledger.release(refs)")
        self.check_open(f"release of step {step} ({reason})")
        if not self.store.claims_per_release:
            return self.delete(refs, reason=reason, max_concurrency=max_concurrency)
        result = self._releases.release(step, refs, reason)
        self._report(result)
        return result

    def delete_nodes(self, nodes: Mapping[str, Sequence[str]], *, reason: str,
                     max_concurrency: int = 8) -> DeleteResult:
        """``delete`` for chunks found by listing (the sweep), which has no refs: committed ones, and shipped ones
        that lost their commit marker (the claim then checks a listed key is still there, not the marker).

        Args:
            nodes: node key (``payloads/<shard>/<branch_id>``) -> every key listed under it
                (the commit marker, the chunk, stray temp files); all are deleted once claimed.

        Raises:
            As ``delete``.
        """
        targets = []
        for node, keys in nodes.items():
            present = meta_key(node) if meta_key(node) in keys else sorted(keys)[0]  # damaged: no zarr.json
            targets.append(Target(branch_id_of(node), self.store.uri(node), present, list(keys)))
        return self._delete_targets(targets, reason, max_concurrency)

    def remove_leftovers(self, nodes: Mapping[str, Sequence[str]], *, event: str,
                         reason: str) -> dict[str, StorageError]:
        """Delete keys of chunks that need no claim, recording one ``event`` per chunk.

        For the sweep: chunks whose delete record exists but whose objects remain (a deleter died mid-delete;
        ``event="finish_delete"``), and incomplete keeps (no commit marker: never kept, so nothing to claim;
        ``event="remove_incomplete"``).

        Args:
            nodes: node key -> every key listed under it.

        Returns:
            Node URI -> the store error of a key that could not be deleted (after the store's retries), for the
            chunks not finished; every other chunk's keys were deleted.
        """
        for node in nodes:
            self.record(event, branch_id=branch_id_of(node), uri=self.store.uri(node), reason=reason)
        failed: dict[str, StorageError] = {}
        try:
            self.store.delete_keys([key for keys in nodes.values() for key in keys])
        except DeleteKeysError as e:
            failed = e.failed
        self.flush()
        return {self.store.uri(node): next(failed[k] for k in keys if k in failed)
                for node, keys in nodes.items() if any(k in failed for k in keys)}

    def _delete_targets(self, targets: list[Target], reason: str, max_concurrency: int,
                        held: Sequence[tuple[Target, StorageError]] = (), batch: bool = False) -> DeleteResult:
        """Delete ``targets``, each claimed by its own delete record, or (``batch``: a store that
        ``claims_by_unlink``) those not unfinished by one batch record (``storage.ledger_batch``)."""
        self.check_open(f"delete ({reason})")
        result = DeleteResult()
        for target, refused in held:  # a shared prefix's release refused (storage.ledger_holds)
            self._note(target, refused, reason, result)
        seen: set[str] = set()
        firsts: list[Target] = []
        repeats: list[Target] = []
        for t in targets:
            (repeats if t.branch_id in seen else firsts).append(t)
            seen.add(t.branch_id)
        singles = firsts
        if batch:
            with self._lock:
                fresh = [t for t in firsts if t.branch_id not in self._unfinished]
            if fresh:
                self._batches.delete(fresh, reason, result)
            singles = [t for t in firsts if t not in fresh]
        self._delete_singles(singles, reason, max_concurrency, result)
        for target in repeats:  # the same chunk twice in one call: the second is a double delete
            self._note(target, double_delete_error(target.uri, first_holder=self.actor, second_holder=self.actor,
                                                   first_reason=f"{reason}, earlier in this call", reason=reason)
                       if batch else self._claim(target, reason), reason, result)
        for target in firsts:
            if target.uri in result.failed:
                self.record("unfinished_delete", branch_id=target.branch_id, uri=target.uri, reason=reason,
                            error=str(result.failed[target.uri]))
        self._report(result)
        return result

    def _delete_singles(self, targets: list[Target], reason: str, max_concurrency: int, result: DeleteResult) -> None:
        """Claim each of ``targets`` by its own delete record (in parallel), then delete the claimed ones."""
        started = time.perf_counter()
        claims = bounded_map(lambda t: self._claim(t, reason), targets, max(1, max_concurrency))
        self._add_seconds(time.perf_counter() - started)
        doomed = [t for t, problem in zip(targets, claims) if problem is None or isinstance(problem, EarlierLife)]
        earlier = {t.uri for t, problem in zip(targets, claims) if isinstance(problem, EarlierLife)}
        for target, problem in zip(targets, claims):
            self._note(target, problem, reason, result)
        self._remove(doomed, result, earlier)

    def _report(self, result: DeleteResult) -> None:
        """Flush a delete's problems and failures at once; raise its double and unknown deletes."""
        if result.double_deletes or result.unknown or result.failed:
            self._flush_now()
        if result.double_deletes or result.unknown:
            raise_problems(result)

    def _flush_now(self) -> None:
        """Put a delete's problems on record before anything else can fail; when the store refuses the segment too,
        the events stay buffered for the next flush and the delete still returns its result (never raises it)."""
        try:
            self.flush()
        except StorageError as e:
            log.warning("ledger %s: delete events stay buffered for the next flush: %s", self.actor, e)

    def _note(self, target: Target, problem: StorageError | EarlierLife | None, reason: str,
              result: DeleteResult) -> None:
        """Add a claim's problem to ``result`` (and the double and unknown deletes, and earlier lives, to the log)."""
        if isinstance(problem, EarlierLife):
            self.record("already_released", branch_id=target.branch_id, uri=target.uri, reason=reason,
                        first_session=problem.session)
        elif isinstance(problem, DoubleDeleteError):
            result.double_deletes[target.uri] = problem
            self.record("double_delete", branch_id=target.branch_id, uri=target.uri, reason=reason,
                        first=problem.first_holder, first_reason=problem.first_reason)
        elif isinstance(problem, UnknownRefError):
            result.unknown[target.uri] = problem
            self.record("unknown_delete", branch_id=target.branch_id, uri=target.uri, reason=reason)
        elif problem is not None:
            result.failed[target.uri] = problem

    def _remove(self, doomed: list[Target], result: DeleteResult, earlier: set[str]) -> None:
        """Delete the objects of claimed chunks (``earlier``: URIs an earlier life of this actor claimed); a chunk
        with a key the store could not delete stays unfinished."""
        failed: dict[str, StorageError] = {}
        try:
            self.store.delete_keys([key for target in doomed for key in target.keys])
        except DeleteKeysError as e:
            failed = e.failed
        except StorageError as e:
            failed = {key: e for target in doomed for key in target.keys}
        for target in doomed:
            error = next((failed[k] for k in target.keys if k in failed), None)
            if error is None:
                (result.already_released if target.uri in earlier else result.deleted).append(target.uri)
                with self._lock:
                    self._unfinished.pop(target.branch_id, None)
            else:
                result.failed[target.uri] = error

    @property
    def unfinished(self) -> list[str]:
        """URIs of this holder's unfinished deletes (claim or object removal failed), oldest first."""
        with self._lock:
            chunks = [u.target.uri for u in self._unfinished.values()]
        return chunks + self._releases.unfinished()

    def finish_unfinished(self) -> DeleteResult:
        """Retry this holder's unfinished deletes with their own claims (never a double delete of its own).

        Called by the holders at their next delete (trainer release, orchestrator, keeper) and by ``close``.

        Raises:
            DoubleDeleteError: another holder claimed one meanwhile (``.result`` as in ``delete``).
        """
        with self._lock:
            pending = list(self._unfinished.values())
        result = DeleteResult()
        self._releases.finish(result)
        for reason in dict.fromkeys(u.reason for u in pending):
            part = self._delete_targets([u.target for u in pending if u.reason == reason], reason, 8)
            result.deleted += part.deleted
            result.failed.update(part.failed)
        return result

    def _claim(self, target: Target, reason: str) -> StorageError | EarlierLife | None:
        """Claim one chunk: None when this holder holds the claim (this call's or its own earlier one), else the
        problem: ``DoubleDeleteError``, ``UnknownRefError``, the store error that left the claim unresolved, or
        ``EarlierLife`` when this actor's earlier session claimed it (its objects are still removed)."""
        with self._lock:
            pending = self._unfinished.get(target.branch_id)
        if pending is not None and pending.claimed:
            return None
        tomb = tombstone_key(target.branch_id)
        try:
            if pending is None and not self.store.exists(target.meta_key):
                problem = self._already_deleted(target, tomb, reason, None)
                if problem is not None or not self.store.appears(target.meta_key):
                    return problem or UnknownRefError(
                        f"chunk {target.uri}: delete by {self.actor} ({reason}) refused: it was never kept "
                        f"(no commit marker, no delete record)")
            if pending is None:
                claim = uuid.uuid4().hex
                record = DeleteRecord(branch_id=target.branch_id, uri=target.uri, holder=self.actor, reason=reason,
                                      t=round(time.time(), 3), session=self.session, claim=claim)
                pending = Unfinished(target, reason, record.model_dump_json().encode(), claim)
                with self._lock:
                    self._unfinished[target.branch_id] = pending
            try:
                self.store.put(tomb, pending.record, exclusive=True)
            except KeyExistsError:
                problem = self._already_deleted(target, tomb, reason, pending.claim)
                if problem is not None:
                    with self._lock:
                        self._unfinished.pop(target.branch_id, None)
                    return problem
        except StorageError as e:
            return e
        pending.claimed = True
        return None

    def _already_deleted(self, target: Target, tomb: str, reason: str,
                         claim: str | None) -> DoubleDeleteError | EarlierLife | None:
        """The double delete found at ``tomb``; None when there is no delete record, or it is
        this holder's own claim (its put was applied, and the answer lost); ``EarlierLife`` when
        this actor wrote it in an earlier session (a restarted holder releasing again what its
        earlier life had released)."""
        try:
            first = read_delete_record(self.store.get(tomb), self.store.uri(tomb))
        except KeyNotFoundError:
            if claim is None:
                return None
            first_holder, first_reason = "?", "delete record vanished"
        except DeleteRecordError as e:
            first_holder, first_reason = "?", str(e)
        else:
            if claim is not None and first.claim == claim:
                return None
            if first.holder == self.actor and first.session != self.session:
                return EarlierLife(first.session)
            first_holder, first_reason = first.holder, first.reason
        return double_delete_error(target.uri, first_holder=first_holder, first_reason=first_reason,
                                   second_holder=self.actor, reason=reason)

__all__ = ["Ledger"]
