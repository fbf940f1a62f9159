"""Liveness of ledger sessions across hosts: a heartbeat object per session under the run prefix.

Each ``Ledger`` session rewrites ``ledger/heartbeats/<actor>/<session>.json`` every
``heartbeat_interval_s`` (``StorageConfig``; default 5 s) from a daemon thread, and once more
with ``"closed": true`` when it closes. The body carries the writer's pid, host, a beat counter
and its own interval and timeout (default 15 s = 3 missed beats, torchelastic's 5 s x 3).

A reader judges a session by *its own* clock, never by comparing a timestamp of the writer's
with it (clocks of different nodes disagree): the session is live once its heartbeat body
changed between two looks; dead once the body said closed, or did not change for the timeout
the writer stated, or has no heartbeat at all. Two shortcuts need no waiting and hold on the
reader's own host only: a session of this very process is live while its ``Ledger`` object is,
and a session whose pid no longer exists on this host is dead. Everything else costs the reader
up to one interval (live) or one timeout (dead). ``SessionWatch`` judges the same way without
blocking, for a process that looks again and again (the orchestrator watching the trainer ranks).

No shared mutable file: each heartbeat object has one writer.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from refpipe.storage.errors import KeyNotFoundError, RefpipeError
from refpipe.storage.layout import heartbeat_key
from refpipe.storage.store import Store

log = logging.getLogger(__name__)
_LOCAL: weakref.WeakValueDictionary[tuple[str, str], object] = weakref.WeakValueDictionary()
"""(actor, session) -> the live owner object in this process (session ids hold pid and open time)."""


class Heartbeat:
    """The heartbeat of one session, kept alive by a daemon thread while ``owner`` exists.

    Called by ``Ledger``: ``start`` before the session's ``open`` event, ``close`` after its
    ``close`` event. A failed rewrite is logged and retried at the next beat (a reader may then
    judge the session dead: the ledger's delete claims keep exactly-once regardless).
    """

    def __init__(self, store: Store, actor: str, session: str, owner: object):
        self.store, self.key, self._owner = store, heartbeat_key(actor, session), weakref.ref(owner)
        self.interval_s = store.config.heartbeat_interval_s
        self._body: dict[str, Any] = {
            "actor": actor, "session": session, "pid": os.getpid(), "host": socket.gethostname(),
            "interval_s": self.interval_s, "timeout_s": store.config.heartbeat_timeout_s, "beat": 0, "closed": False}
        self._stop = threading.Event()
        _LOCAL[(actor, session)] = owner

    def start(self) -> None:
        """Write the first beat (synchronously), then beat every ``interval_s`` in the background."""
        self._put()
        threading.Thread(target=self._run, daemon=True, name=f"heartbeat-{self.key}").start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self._owner() is not None:
            self._body["beat"] += 1
            try:
                self._put()
            except (RefpipeError, OSError) as e:
                log.warning("heartbeat %s not written: %s", self.key, e)

    def _put(self) -> None:
        self.store.put(self.key, json.dumps(self._body).encode())

    def close(self) -> None:
        """Stop beating and write the last beat, ``closed``: readers judge the session dead at once."""
        self._stop.set()
        self._body.update(beat=self._body["beat"] + 1, closed=True)
        self._put()


def _read(store: Store, key: str) -> bytes | None:
    try:
        return store.get(key)
    except KeyNotFoundError:
        return None


CLOSED = "closed"
"""``SessionWatch``'s reason for a session that ended cleanly (its last beat said so)."""


def _verdict_now(body: bytes | None) -> bool | None:
    """Live/dead when one look decides it (missing, closed, unreadable, or a local shortcut), else None."""
    return _look(body)[0]


def _look(body: bytes | None) -> tuple[bool | None, str]:
    """``(_verdict_now, why)``: why a session is dead, or whose it is (``pid <pid> on <host>``)."""
    if body is None:
        return False, "no heartbeat"
    try:
        beat = json.loads(body)
        actor, session, pid, host = beat["actor"], beat["session"], int(beat["pid"]), beat["host"]
        _timing(beat)
    except (ValueError, KeyError, TypeError):
        return False, "unreadable heartbeat"
    if beat.get("closed"):
        return False, CLOSED
    whose = f"pid {pid} on {host}"
    if host == socket.gethostname():
        if pid == os.getpid():
            if (actor, session) in _LOCAL:
                gc.collect()  # an owner only a reference cycle keeps is gone
            return (actor, session) in _LOCAL, "its owner in this process is gone"
        if not _pid_exists(pid):
            return False, f"{whose} exited"
    return None, whose


def _timing(beat: dict[str, Any]) -> tuple[float, float]:
    """``(timeout_s, interval_s)`` a heartbeat states, within ``StorageConfig``'s bounds.

    Raises:
        ValueError: missing, not numbers, or out of bounds (a reader would wait forever on a NaN or huge one).
    """
    timeout_s, interval_s = float(beat["timeout_s"]), float(beat["interval_s"])
    if not (0 < interval_s <= 600 and 2 * interval_s <= timeout_s <= 3600):
        raise ValueError(f"timeout_s={timeout_s}, interval_s={interval_s}: outside StorageConfig's bounds")
    return timeout_s, interval_s


def _pid_exists(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and has not exited (a zombie, exited but not yet
    reaped, has ``/proc/<pid>/stat`` state ``Z``; without procfs, existence is all we know)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def live_sessions(store: Store, sessions: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of ``(actor, session)`` are live by their heartbeats (module docstring).

    Blocks for up to the longest stated timeout when a session's heartbeat stopped changing,
    up to one interval for live sessions of other processes, not at all otherwise.
    """
    first = {s: _read(store, heartbeat_key(*s)) for s in sessions}
    live, pending = set(), {}
    for s, body in first.items():
        verdict = _verdict_now(body)
        if verdict:
            live.add(s)
        elif verdict is None and body is not None:  # (a missing body is dead: verdict False)
            pending[s] = _timing(json.loads(body))
    started = time.monotonic()
    while pending:
        time.sleep(max(0.05, min(1.0, min(interval for _, interval in pending.values()) / 2)))
        waited = time.monotonic() - started
        for s in list(pending):
            body = _read(store, heartbeat_key(*s))
            if body != first[s]:
                if _verdict_now(body) is not False:
                    live.add(s)
                del pending[s]
            elif waited >= pending[s][0]:
                del pending[s]
    return live


class SessionWatch:
    """Liveness of sessions looked at again and again, without blocking (module docstring).

    Each ``dead`` call reads every given session's heartbeat once. A session whose heartbeat
    changed between two looks is ``seen_live``; a session is dead at a look when that look decides
    it (closed, no heartbeat, or a local shortcut), or when its heartbeat is still the body an
    earlier look first saw at least the writer's stated timeout ago, by this process's monotonic
    clock. Called from one thread (the orchestrator's loop).
    """

    def __init__(self, store: Store):
        self.store = store
        self.seen_live: set[tuple[str, str]] = set()
        self._seen: dict[tuple[str, str], tuple[bytes, float]] = {}

    def dead(self, sessions: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """The sessions of ``sessions`` that are dead by now -> why (``CLOSED`` for a clean end)."""
        now, dead = time.monotonic(), {}
        for s in sessions:
            body = _read(self.store, heartbeat_key(*s))
            verdict, why = _look(body)
            if verdict is False or body is None:  # (a missing body is dead: verdict False)
                dead[s] = why
                continue
            body_seen, since = self._seen.get(s, (None, now))
            if body != body_seen:
                if body_seen is not None or verdict:
                    self.seen_live.add(s)
                self._seen[s] = (body, now)
            elif verdict is None and now - since >= (timeout_s := _timing(json.loads(body))[0]):
                dead[s] = f"{why}: heartbeat {self.store.uri(heartbeat_key(*s))} unchanged for {timeout_s:g} s"
        return dead
