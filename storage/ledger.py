"""The reference ledger: per-actor event logs and delete-exactly-once.

Layout under the run prefix (keys built and parsed by ``storage.layout``):

    ledger/events/<actor>/<session>/<bucket>/<seq>.jsonl
                                                   one session's events, one JSON object per
                                                   line ending in its ``crc`` (``encode_record``),
                                                   written as whole segments (``<pid>-<ms>``
                                                   is the session: one ``Ledger`` instance),
                                                   1,000 per bucket (``layout.segment_key``)
    ledger/deletes/<aa>/<bb>/<branch_id>.json      a chunk's delete record (its tombstone)

Every actor (env-server worker, orchestrator, trainer DP rank) writes only its own
segments, each with one exclusive put, so there is no shared file to append to and
no object to read-modify-write. Keeps are recorded twice: by the chunk itself
(``zarr.json`` names the writer) and by a buffered ``keep`` event; ships and borrows
by the step file; deletes by the tombstone.

The tombstone is the atomic claim: it is written with an exclusive put (``link(2)``
on a filesystem, ``If-None-Match: *`` on S3), so of any number of deleters of one
chunk exactly one succeeds; the others read the winner's record, record a
``double_delete`` event and raise ``DoubleDeleteError`` naming both holders,
deleting nothing else.

Sessions and liveness (what ``pipeline.audit`` relies on): a session is live while
its heartbeat (``storage.liveness``: an object under the run prefix the session
rewrites every few seconds) keeps changing, until its ``close`` event, or until the
run is declared stopped. One live session per actor: a ``Ledger`` whose actor already
has a live session (on any host) is refused at construction, naming that session.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import crc32c
from pydantic import BaseModel, ConfigDict, ValidationError

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.errors import (
    ConfigError,
    DeleteKeysError,
    DeleteRecordError,
    DoubleDeleteError,
    KeyExistsError,
    KeyNotFoundError,
    StorageError,
    UnknownRefError,
    validation_problems,
)
from refpipe.storage.layout import (
    HEARTBEATS_PREFIX,
    branch_id_of,
    check_id,
    chunk_keys,
    heartbeat_key,
    meta_key,
    parse_heartbeat_key,
    segment_key,
    session_id,
    tombstone_key,
)
from refpipe.storage.liveness import Heartbeat, live_sessions
from refpipe.storage.store import Store

log = logging.getLogger(__name__)
SEGMENT_MAX_EVENTS = 512
SEGMENT_MAX_AGE_S = 2.0


CRC_FIELD = "crc"
"""The field each ledger line ends with: crc32c (8 hex digits) of ``canonical_record`` of the rest of the line."""


def canonical_record(event: Mapping[str, Any]) -> bytes:
    """The bytes a ledger line's crc covers: the event without its crc, as compact JSON with sorted keys."""
    return json.dumps(event, separators=(",", ":"), sort_keys=True).encode()


def encode_record(event: Mapping[str, Any]) -> bytes:
    """One ledger line: ``event`` as compact JSON with its ``crc`` appended, then a line end (the one encoder;
    ``read_segment`` checks it).

    Raises:
        ValueError: ``event`` already holds a ``crc`` field.
    """
    if CRC_FIELD in event:
        raise ValueError(f"ledger event {event.get('event')!r}: the field name {CRC_FIELD!r} is the line's own")
    crc = crc32c.crc32c(canonical_record(event))
    return json.dumps({**event, CRC_FIELD: f"{crc:08x}"}, separators=(",", ":")).encode() + b"\n"


def _decode_record(line: bytes) -> dict[str, Any]:
    """The event of one complete ledger line, its crc checked and removed.

    Raises:
        ValueError: not JSON (``json.JSONDecodeError``), not an object with an ``event`` name, no crc, or a crc
            that does not match the line's content (the line was changed after the ledger wrote it).
    """
    event = json.loads(line)
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise ValueError(f"{line[:40]!r}: expected a JSON object with an 'event' name")
    stored = event.pop(CRC_FIELD, None)
    computed = f"{crc32c.crc32c(canonical_record(event)):08x}"
    if stored != computed:
        raise ValueError(f"crc32c {computed} of the record, the line says {stored!r} (changed after it was "
                         f"written)" if stored is not None else f"{line[:40]!r}: no {CRC_FIELD!r} field")
    return event


def read_segment(data: bytes) -> list[tuple[int, dict[str, Any] | ValueError]]:
    """Every record of a ledger segment, tolerantly: ``(line number, event)`` per non-empty line, or
    ``(line number, ValueError)`` for a line that is not a JSON object with an ``event`` name, whose
    crc32c is missing or does not match (``encode_record``), or a last line without its line end. Never
    raises: the one reader of segments, shared by the audit and sweep, ``refpipe ls`` and the trainer's
    resume. Callers decide what a bad record means (the audit: a violation that blocks the sweep)."""
    lines = data.split(b"\n")
    out: list[tuple[int, dict[str, Any] | ValueError]] = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            if number == len(lines):
                raise ValueError("truncated record (no line end)")
            out.append((number, _decode_record(line)))
        except ValueError as e:  # json.JSONDecodeError included
            out.append((number, e))
    return out


class DeleteRecord(BaseModel):
    """A chunk's delete record (``ledger/deletes/<aa>/<bb>/<branch_id>.json``): the exactly-once claim, written
    once by ``Ledger`` (exclusive put) and read only through ``read_delete_record``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    branch_id: str
    uri: str
    """The deleted chunk's URI as its deleter saw it."""
    holder: str
    """The actor that deleted it."""
    reason: str
    """Why (the deletion path)."""
    t: float
    """Unix time of the claim, seconds."""
    session: str
    """The deleter's ledger session."""
    claim: str
    """Random per claim: a deleter whose put's answer was lost recognises its own record."""


def read_delete_record(data: bytes, uri: str) -> DeleteRecord:
    """The one reader of delete records: the ledger's claims (every holder's delete, the sweep) and the CLI's
    ``deleted by`` lines (``show``, ``verify``, ``inspect``).

    Raises:
        DeleteRecordError: ``data`` is not a ``DeleteRecord`` (names ``uri`` and each field that is wrong).
    """
    try:
        return DeleteRecord.model_validate_json(data)
    except ValidationError as e:
        raise DeleteRecordError(f"delete record {uri} is unreadable: {validation_problems(e)}") from None


def delete_record_of(store: Store, branch_id: str) -> DeleteRecord | DeleteRecordError | None:
    """The delete record of ``branch_id``'s chunk, the error that makes it unreadable, or None when there is none:
    how a missing chunk is explained (``storage.chunk_read`` after a not-found; the CLI's ``show``, ``verify``,
    ``inspect``). One ``Store.get``."""
    key = tombstone_key(branch_id)
    try:
        return read_delete_record(store.get(key), store.uri(key))
    except KeyNotFoundError:
        return None
    except DeleteRecordError as e:
        return e


@dataclass
class DeleteResult:
    """Outcome of one ``Ledger.delete`` call: each ref in exactly one outcome (``outcome``)."""

    deleted: list[str] = field(default_factory=list)
    """URIs this call deleted (claimed, by this call or by this holder's earlier unfinished call, and removed)."""
    double_deletes: list[DoubleDeleteError] = field(default_factory=list)
    """Chunks another holder (or this one, in an earlier finished delete) had already deleted."""
    unknown: list[UnknownRefError] = field(default_factory=list)
    """Refs that were never kept: no commit marker and no delete record."""
    already_released: list[str] = field(default_factory=list)
    """URIs this actor claimed in an earlier session (an earlier life of the same actor): already released,
    not a double delete; any objects the earlier life left are removed."""
    failed: dict[str, StorageError] = field(default_factory=dict)
    """URI -> the store error (after the store's retries) that stopped its claim or the removal of its objects:
    an unfinished delete this ledger keeps and retries with the same claim (``finish_unfinished``)."""

    def outcome(self, uri: str) -> str:
        """``"deleted"``, ``"already_released"``, ``"double_delete"``, ``"unknown"`` or ``"failed"`` for a ref's URI
        of this call."""
        if uri in self.failed:
            return "failed"
        if uri in self.deleted:
            return "deleted"
        if uri in self.already_released:
            return "already_released"
        if any(uri in str(e) for e in self.double_deletes):
            return "double_delete"
        return "unknown"


class _EarlierLife(NamedTuple):
    """A claim found at a chunk's delete record written by this actor's earlier session."""

    session: str


class _Target(NamedTuple):
    """One chunk to delete: its branch id, node URI, commit-marker key, and every key to remove."""

    branch_id: str
    uri: str
    meta_key: str
    keys: list[str]


@dataclass
class _Unfinished:
    """A delete this holder started and has not finished: its target, reason and claim record (reused on retry)."""

    target: _Target
    reason: str
    record: bytes
    claim: str
    claimed: bool = False
    """The delete record is known to be this claim's (written, or read back)."""


class Ledger:
    """One actor's session of the ledger.

    Every process creates one ``Ledger`` per actor it plays, with a unique ``actor``
    name (``env_worker_3``, ``orchestrator``, ``trainer_dp0``), after any fork, and
    calls ``close`` at a clean shutdown. Construction writes the session's ``open``
    event at once (one put, plus one refused put that probes exclusivity): from then
    on the audit counts the session as a live holder of the chunks it keeps, and a new
    ``Ledger`` under the same actor name ends it. Later events are buffered and written as one
    segment per 512 events, per 2 s (checked on the next ``record``), on ``flush``,
    at ``close``, and right after a delete that found a problem.

    Args:
        store: the run's store.
        actor: who this is (1-128 of ``[A-Za-z0-9._-]``); names the holder in delete
            records and errors.

    Attributes:
        session: ``<pid>-<ms>``, unique per actor; names this session's segments.
        ledger_seconds: wall-clock seconds spent in ledger I/O so far (segment puts,
            delete claims), for ``bench/keep_fetch.py``'s ``ledger_overhead_ratio``.

    Raises:
        ConfigError: ``actor`` is not a valid name, or another session of ``actor`` is live (its
            heartbeat changed; may wait up to one heartbeat timeout to tell a stale one from a live one).
        StorageError: the store does not honour exclusive puts (probed once per session by
            putting the ``open`` segment twice), so exactly-once deletes cannot be guaranteed.
    """

    def __init__(self, store: Store, actor: str):
        check_id(actor, "ledger actor")
        self.store = store
        self.actor = actor
        self.ledger_seconds = 0.0
        self._events: list[dict[str, Any]] = []
        self._seq = 0
        self._flushed_at = time.monotonic()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._unfinished: dict[str, _Unfinished] = {}
        self._flush_failed = False
        self._refuse_a_live_session()
        self.session = self._open()

    def _refuse_a_live_session(self) -> None:
        keys = self.store.list_prefix(f"{HEARTBEATS_PREFIX}/{self.actor}")
        mine = [s for s in map(parse_heartbeat_key, keys) if s and s[0] == self.actor]
        live = sorted(live_sessions(self.store, mine))
        if live:
            raise ConfigError(f"ledger actor {self.actor!r} of run {self.store.prefix.uri} already has a live session "
                              f"{live[0][1]} (its heartbeat {self.store.uri(heartbeat_key(*live[0]))} changed): "
                              f"one process per actor; stop it, or give this one another actor name")

    def _open(self) -> str:
        """Write the ``open`` segment under a fresh session id (the next millisecond on a clash),
        then probe that the store honours exclusive puts by putting at its key again (another call: its write
        token is not the first put's)."""
        opened_ms = int(time.time() * 1000)
        event = {"event": "open", "actor": self.actor, "t": round(time.time(), 3), "pid": os.getpid(),
                 "host": socket.gethostname()}
        while True:
            session = session_id(os.getpid(), opened_ms)
            self._heartbeat = Heartbeat(self.store, self.actor, session, self)
            self._heartbeat.start()  # before the open event: an open session without a heartbeat is dead
            try:
                self._put_segment(session, 0, [event])
            except KeyExistsError:
                opened_ms += 1
                continue
            break
        try:
            self._put_segment(session, 0, [{**event, "probe": True}])
        except KeyExistsError:
            self._seq = 1
            return session
        raise StorageError(f"store {self.store.prefix.uri} does not honour exclusive puts (a second exclusive put "
                           f"of a ledger segment succeeded; a proxy dropping If-None-Match?): refusing to run "
                           f"without delete-exactly-once")

    def record(self, event: str, **fields: object) -> None:
        """Append an event (JSON-serialisable fields) to this session's log; no I/O unless a segment is due."""
        with self._lock:
            self._events.append({"event": event, "actor": self.actor, "t": round(time.time(), 3), **fields})
            due = len(self._events) >= SEGMENT_MAX_EVENTS or time.monotonic() - self._flushed_at > SEGMENT_MAX_AGE_S
        if due:
            self.flush()

    def flush(self) -> None:
        """Write buffered events as one new segment object (one exclusive put); no-op when none are buffered.

        Raises:
            StorageError: the put failed after the store's retries; the events stay buffered for the next flush
                (same segment number: a put that was applied after all is found holding the first of them).
        """
        with self._flush_lock:
            with self._lock:
                events, self._events = self._events, []
                seq = self._seq
                self._flushed_at = time.monotonic()
            if not events:
                return
            try:
                seq = self._put_next_segment(seq, events)
            except StorageError:
                with self._lock:
                    self._events[:0] = events
                    self._flush_failed = True
                raise
            with self._lock:
                self._seq, self._flush_failed = seq, False

    def _put_next_segment(self, seq: int, events: list[dict[str, Any]]) -> int:
        """Put ``events`` as segment ``seq``; return the next segment number. After a failed flush, segment ``seq``
        may exist although its put failed (applied, its answer lost): when it holds exactly the first events
        buffered, only the rest are put, from ``seq + 1``.

        Raises:
            KeyExistsError: segment ``seq`` holds something else.
        """
        try:
            self._put_segment(self.session, seq, events)
            return seq + 1
        except KeyExistsError:
            if not self._flush_failed:
                raise
            stored = self.store.get(segment_key(self.actor, self.session, seq))
            lines = [encode_record(event) for event in events]
            written = next((n for n in range(1, len(lines) + 1) if b"".join(lines[:n]) == stored), None)
            if written is None:
                raise
        return self._put_next_segment(seq + 1, events[written:]) if written < len(events) else seq + 1

    def _put_segment(self, session: str, seq: int, events: list[dict[str, Any]]) -> None:
        body = b"".join(map(encode_record, events))
        started = time.perf_counter()
        try:
            self.store.put(segment_key(self.actor, session, seq), body, exclusive=True)
        finally:
            self._add_seconds(time.perf_counter() - started)

    def _add_seconds(self, seconds: float) -> None:
        with self._lock:
            self.ledger_seconds += seconds

    def close(self) -> None:
        """Retry unfinished deletes once more, record a clean end of this session and flush; the last heartbeat
        says closed.

        What is still unfinished is left to ``refpipe sweep`` (the delete records exist, or the
        chunks are leaked and claimed there).
        """
        if self.unfinished:
            try:
                self.finish_unfinished()
            except (DoubleDeleteError, UnknownRefError):
                pass  # recorded as events; the audit reports them
        self.record("close")
        self.flush()
        self._heartbeat.close()

    def record_keep(self, ref: PayloadRef) -> None:
        """Record that this actor kept ``ref`` (buffered; the chunk's ``zarr.json`` also names the writer)."""
        self.record("keep", branch_id=ref.branch_id, uri=ref.uri, nbytes=ref.nbytes)

    def delete(self, refs: Sequence[PayloadRef], *, reason: str, max_concurrency: int = 8) -> DeleteResult:
        """Delete chunks exactly once, recording who deleted each and why.

        Each ref's chunk is the one its branch id names in this run (``PayloadRef.key``, checked
        against its URI before any I/O). For each ref, in parallel: check
        the commit marker (``zarr.json``), claim with an exclusive put of the delete record;
        then the claimed chunks' objects are deleted (S3: batched ``DeleteObjects``),
        commit marker first, so a fetch after a delete is ``ChunkNotFoundError``.

        A store error that outlasts the store's retries never raises: that ref's outcome is
        ``failed`` (``DeleteResult.failed``), recorded as an ``unfinished_delete`` event and kept
        by this ledger with its claim; ``delete`` of the same ref again, ``finish_unfinished`` and
        ``close`` finish it with that claim (never a double delete of its own), and ``refpipe
        sweep`` at the latest (the audit lists a claimed chunk still present as unfinished).

        Args:
            refs: chunks to delete.
            reason: why (the deletion path); stored in the delete record.
            max_concurrency: threads claiming at once.

        Raises:
            OutsideRunError: a ref's URI names another chunk than its branch id (nothing deleted).
            DoubleDeleteError: some chunks were already deleted; every other chunk was
                deleted. ``.result`` holds the full ``DeleteResult``.
            UnknownRefError: some refs were never kept (and none double-deleted); ``.result`` as above.
        """
        targets = []
        for ref in refs:
            data_key, meta_key = chunk_keys(ref.key)
            targets.append(_Target(ref.branch_id, self.store.uri(ref.key), meta_key, [meta_key, data_key]))
        return self._delete_targets(targets, reason, max_concurrency)

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
            targets.append(_Target(branch_id_of(node), self.store.uri(node), present, list(keys)))
        return self._delete_targets(targets, reason, max_concurrency)

    def remove_leftovers(self, nodes: Mapping[str, Sequence[str]], *, event: str,
                         reason: str) -> dict[str, StorageError]:
        """Delete keys of chunks that need no claim, recording one ``event`` per chunk.

        For the sweep: chunks whose delete record exists but whose objects remain (a
        deleter died mid-delete; ``event="finish_delete"``), and incomplete keeps (no
        commit marker: never kept, so nothing to claim; ``event="remove_incomplete"``).

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

    def _delete_targets(self, targets: list[_Target], reason: str, max_concurrency: int) -> DeleteResult:
        result = DeleteResult()
        seen: set[str] = set()
        firsts: list[_Target] = []
        repeats: list[_Target] = []
        for t in targets:
            (repeats if t.branch_id in seen else firsts).append(t)
            seen.add(t.branch_id)
        started = time.perf_counter()
        claims = bounded_map(lambda t: self._claim(t, reason), firsts, max(1, max_concurrency))
        self._add_seconds(time.perf_counter() - started)
        doomed = [t for t, problem in zip(firsts, claims) if problem is None or isinstance(problem, _EarlierLife)]
        earlier = {t.uri for t, problem in zip(firsts, claims) if isinstance(problem, _EarlierLife)}
        for target, problem in zip(firsts, claims):
            self._note(target, problem, reason, result)
        self._remove(doomed, result, earlier)
        for target in repeats:  # the same chunk twice in one call: the second is a double delete
            self._note(target, self._claim(target, reason), reason, result)
        for target in firsts:
            if target.uri in result.failed:
                self.record("unfinished_delete", branch_id=target.branch_id, uri=target.uri, reason=reason,
                            error=str(result.failed[target.uri]))
        if result.double_deletes or result.unknown or result.failed:
            self._flush_now()
        if result.double_deletes or result.unknown:
            self._raise_problems(result)
        return result

    def _flush_now(self) -> None:
        """Put a delete's problems on record before anything else can fail; when the store refuses the segment too,
        the events stay buffered for the next flush and the delete still returns its result (never raises it)."""
        try:
            self.flush()
        except StorageError as e:
            log.warning("ledger %s: delete events stay buffered for the next flush: %s", self.actor, e)

    def _note(self, target: _Target, problem: StorageError | _EarlierLife | None, reason: str,
              result: DeleteResult) -> None:
        """Add a claim's problem to ``result`` (and the double and unknown deletes, and earlier lives, to the log)."""
        if isinstance(problem, _EarlierLife):
            self.record("already_released", branch_id=target.branch_id, uri=target.uri, reason=reason,
                        first_session=problem.session)
        elif isinstance(problem, DoubleDeleteError):
            result.double_deletes.append(problem)
            self.record("double_delete", branch_id=target.branch_id, uri=target.uri, reason=reason,
                        first=problem.first_holder)
        elif isinstance(problem, UnknownRefError):
            result.unknown.append(problem)
            self.record("unknown_delete", branch_id=target.branch_id, uri=target.uri, reason=reason)
        elif problem is not None:
            result.failed[target.uri] = problem

    def _remove(self, doomed: list[_Target], result: DeleteResult, earlier: set[str]) -> None:
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
            return [u.target.uri for u in self._unfinished.values()]

    def finish_unfinished(self) -> DeleteResult:
        """Retry this holder's unfinished deletes with their own claims (never a double delete of its own).

        Called by the holders at their next delete (trainer release, orchestrator, keeper) and by ``close``.

        Raises:
            DoubleDeleteError: another holder claimed one meanwhile (``.result`` as in ``delete``).
        """
        with self._lock:
            pending = list(self._unfinished.values())
        result = DeleteResult()
        for reason in dict.fromkeys(u.reason for u in pending):
            part = self._delete_targets([u.target for u in pending if u.reason == reason], reason, 8)
            result.deleted += part.deleted
            result.failed.update(part.failed)
        return result

    def _claim(self, target: _Target, reason: str) -> StorageError | _EarlierLife | None:
        """Claim one chunk: None when this holder holds the claim (this call's or its own earlier one), else the
        problem: ``DoubleDeleteError``, ``UnknownRefError``, the store error that left the claim unresolved, or
        ``_EarlierLife`` when this actor's earlier session claimed it (its objects are still removed)."""
        with self._lock:
            pending = self._unfinished.get(target.branch_id)
        if pending is not None and pending.claimed:
            return None
        tomb = tombstone_key(target.branch_id)
        try:
            if pending is None and not self.store.exists(target.meta_key):
                problem = self._already_deleted(target, tomb, reason, None)
                if problem is not None or not self._appears(target.meta_key):
                    return problem or UnknownRefError(
                        f"chunk {target.uri}: delete by {self.actor} ({reason}) refused: it was never kept "
                        f"(no commit marker, no delete record)")
            if pending is None:
                claim = uuid.uuid4().hex
                record = DeleteRecord(branch_id=target.branch_id, uri=target.uri, holder=self.actor, reason=reason,
                                      t=round(time.time(), 3), session=self.session, claim=claim)
                pending = _Unfinished(target, reason, record.model_dump_json().encode(), claim)
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

    def _appears(self, meta_key: str) -> bool:
        """Whether a commit marker the ref says exists, missing at the first look and without a delete record,
        shows up when looked for again (``max_retries`` times with backoff, counted: a stale cache or a lagging
        replica may hide it at first)."""
        for attempt in range(self.store.config.max_retries):
            self.store.backoff(attempt)
            if self.store.exists(meta_key):
                return True
        return False

    def _already_deleted(self, target: _Target, tomb: str, reason: str,
                         claim: str | None) -> DoubleDeleteError | _EarlierLife | None:
        """The double delete found at ``tomb``; None when there is no delete record, or it is
        this holder's own claim (its put was applied, and the answer lost); ``_EarlierLife`` when
        this actor wrote it in an earlier session (a restarted holder releasing again what its
        earlier life had released)."""
        try:
            first = read_delete_record(self.store.get(tomb), self.store.uri(tomb))
        except KeyNotFoundError:
            if claim is None:
                return None
            return self._double_delete(target, reason, "?", "delete record vanished")
        except DeleteRecordError as e:
            return self._double_delete(target, reason, "?", str(e))
        if claim is not None and first.claim == claim:
            return None
        if first.holder == self.actor and first.session != self.session:
            return _EarlierLife(first.session)
        return self._double_delete(target, reason, first.holder, first.reason)

    def _double_delete(self, target: _Target, reason: str, first_holder: str, first_reason: str) -> DoubleDeleteError:
        return DoubleDeleteError(
            f"chunk {target.uri} was already deleted by {first_holder} ({first_reason}); "
            f"second delete from {self.actor} ({reason})", first_holder=first_holder, second_holder=self.actor)

    @staticmethod
    def _raise_problems(result: DeleteResult) -> None:
        problems = result.double_deletes or result.unknown
        first = problems[0]
        holders = ({"first_holder": first.first_holder, "second_holder": first.second_holder}
                   if isinstance(first, DoubleDeleteError) else {})
        raise type(first)(
            f"{len(result.double_deletes)} double deletes, {len(result.unknown)} deletes of unknown refs "
            f"({len(result.deleted)} other chunks deleted); first: {first}", result=result, **holders)


__all__ = ["DeleteRecord", "DeleteResult", "Ledger", "encode_record", "read_delete_record", "read_segment"]
