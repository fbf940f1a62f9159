"""A ledger session's lifecycle: open (exclusive-put probe, heartbeat), buffered events, segment flushes, close.

A session is one ``LedgerSession`` (the base of ``storage.ledger.Ledger``): ``<pid>-<ms>`` of one actor. It
writes only its own segments (``ledger/events/<actor>/<session>/<bucket>/<seq>.jsonl``, records encoded by
``storage.ledger_records.encode_record``), each with one exclusive put, so there is no shared file to append
to and no object to read-modify-write.

Sessions and liveness (what ``pipeline.audit`` relies on): a session is live while its heartbeat
(``storage.liveness``: an object under the run prefix the session rewrites every few seconds) keeps changing,
until its ``close`` event, or until the run is declared stopped. One live session per actor: a session whose
actor already has a live session (on any host) is refused at construction, naming that session.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import ConfigError, KeyExistsError, LedgerClosedError, StorageError
from refpipe.storage.layout import (
    HEARTBEATS_PREFIX,
    check_id,
    heartbeat_key,
    parse_heartbeat_key,
    segment_key,
    session_id,
)
from refpipe.storage.ledger_records import encode_record
from refpipe.storage.liveness import Heartbeat, live_sessions
from refpipe.storage.store import Store

log = logging.getLogger(__name__)

SEGMENT_MAX_EVENTS = 512
SEGMENT_MAX_AGE_S = 2.0


class LedgerSession:
    """One actor's session of the ledger: its event log and heartbeat (``storage.ledger.Ledger`` adds deletes).

    Construction writes the session's ``open`` event at once (one put, plus one refused put that probes
    exclusivity): from then on the audit counts the session as a live holder of the chunks it keeps, and a
    new session under the same actor name ends it. Later events are buffered and written as one segment per
    512 events, per 2 s (checked on the next ``record``), on ``flush`` and at ``close``.

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
        self._flush_failed = False
        self.closed = False
        self.shipped: dict[str, int] = {}
        """Branch id -> the step this session published it in (``pipeline.publish.publish_step``), so a ref is
        published once: one lookup per ref, no history read (memory: one entry per shipped ref)."""
        self.open_branches: set[str] = set()
        """Ids of the open branches kept through this session in this process (``pipeline.open_branch.OpenBranch``
        adds one when opened or resumed and removes it when closed, discarded or suspended); ``close`` warns of
        any left."""
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
        """Append an event (JSON-serialisable fields) to this session's log; no I/O unless a segment is due.

        Raises:
            LedgerClosedError: the session was closed (its log ends with ``close``); nothing is recorded.
        """
        with self._lock:
            self.check_open(event)
            self._events.append({"event": event, "actor": self.actor, "t": round(time.time(), 3), **fields})
            self.closed = event == "close"  # atomically with the event: nothing can follow it in the log
            due = len(self._events) >= SEGMENT_MAX_EVENTS or time.monotonic() - self._flushed_at > SEGMENT_MAX_AGE_S
        if due:
            self.flush()

    def check_open(self, what: str) -> None:
        """Raise before ``what`` (an event, or an act that records one: a keep, a delete) once the session is closed.

        Raises:
            LedgerClosedError: naming the session, the actor, the run and ``what``.
        """
        if self.closed:
            raise LedgerClosedError(f"ledger session {self.session} of actor {self.actor!r} of run "
                                    f"{self.store.prefix.uri} is closed: {what!r} refused, nothing done (open a "
                                    f"new Ledger for the actor)")

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
        """Record a clean end of this session and flush; the last heartbeat says closed. A second call does
        nothing. Open branches still open through this session (``open_branches``) do not stop it: a warning names
        them (they can append, close, suspend or discard no more; their rows are leaked until ``refpipe sweep``
        removes them): close, suspend or discard each before closing its ledger."""
        if self.closed:
            return
        if self.open_branches:
            log.warning("ledger session %s of actor %r closed with open branches %s still open: they can be closed, "
                        "suspended or discarded no more, and their rows are leaked until `refpipe sweep` removes "
                        "them; close, suspend or discard each open branch before Ledger.close", self.session,
                        self.actor, sorted(self.open_branches))
        self.record("close")
        self.flush()
        self._heartbeat.close()

    def record_keep(self, ref: PayloadRef) -> None:
        """Record that this actor kept ``ref`` (buffered; the chunk's ``zarr.json`` also names the writer), with the
        holders of a shared prefix (``PayloadRef.holders``)."""
        self.record("keep", branch_id=ref.branch_id, uri=ref.uri, nbytes=ref.nbytes,
                    **({"holders": list(ref.holders)} if ref.holders else {}))


__all__ = ["SEGMENT_MAX_AGE_S", "SEGMENT_MAX_EVENTS", "LedgerSession"]
