"""The orchestrator's side of the env-server replicas: connections, requests in flight, processes.

One ``multiprocessing.connection`` per replica (``job.roles``), carrying pickled
``GroupRequest``s one way and ``GroupResult``s the other; ``None`` asks a replica to stop. A
replica whose connection ends while the run goes on is dead (its groups are re-sent by
``job.dispatch``); once the fleet is stopping, an end of connection only means that replica is done.

``TrainerWatch`` is the orchestrator's watch of the trainer ranks, wherever they run: by their
ledger sessions' heartbeats (``storage.liveness``), so a trainer node that died is noticed within
``storage.heartbeat_timeout_s`` (+ one interval), not only at ``job.step_deadline_s``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import cast

from refpipe.job.env_worker import GroupRequest, GroupResult
from refpipe.job.roles import authkey, connect_replica, exit_reason
from refpipe.storage.layout import HEARTBEATS_PREFIX, parse_heartbeat_key, trainer_actor
from refpipe.storage.liveness import CLOSED, SessionWatch
from refpipe.storage.store import Store

STOP_TIMEOUT_S = 30.0
"""Seconds the replicas get to answer a stop (finish their group, discard it, close their ledger)."""


@dataclass
class Fleet:
    """The replicas the orchestrator talks to and the processes this process started.

    ``env_procs``/``trainers`` are the subprocesses ``refpipe run`` started (empty under
    ``refpipe orchestrate``, where the roles run elsewhere).
    """

    conns: list[Connection | None]
    env_procs: list[subprocess.Popen] = field(default_factory=list)
    trainers: list[subprocess.Popen] = field(default_factory=list)
    in_flight: list[dict[int, GroupRequest]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    stopping: bool = False
    trainer_watch: "TrainerWatch | None" = None

    def dead_trainers(self) -> list[str]:
        """One line per trainer rank known dead: a started process that failed, or (wherever it runs) a
        ledger session whose heartbeat stopped (``TrainerWatch``)."""
        failed = [f"trainer rank {rank} ({exit_reason(proc.returncode)})"
                  for rank, proc in enumerate(self.trainers) if proc.poll() not in (None, 0)]
        return failed or (self.trainer_watch.dead() if self.trainer_watch else [])

    def live(self) -> list[int]:
        """Replicas whose connection is open."""
        return [w for w, conn in enumerate(self.conns) if conn is not None]

    def send(self, replica: int, request: GroupRequest | None) -> bool:
        """Send one request (``None``: stop); False when the connection is gone."""
        conn = self.conns[replica]
        assert conn is not None  # callers send to live replicas only
        try:
            conn.send(request)
            return True
        except OSError:
            return False

    def receive(self, timeout_s: float) -> tuple[list[GroupResult], list[int]]:
        """Results that arrived within ``timeout_s`` and replicas whose connection ended (closed here)."""
        by_conn = {conn: w for w, conn in enumerate(self.conns) if conn is not None}  # the live ones
        results: list[GroupResult] = []
        ended: list[int] = []
        for ready in wait(list(by_conn), timeout_s) if by_conn else []:
            conn = cast(Connection, ready)  # wait returns some of the connections it was given
            try:
                while True:
                    results.append(conn.recv())
                    if not conn.poll(0):
                        break
            except (EOFError, OSError):
                ended.append(by_conn[conn])
                self.close(by_conn[conn])
        return results, ended

    def close(self, replica: int) -> None:
        conn, self.conns[replica] = self.conns[replica], None
        if conn is not None:
            conn.close()


def connect_fleet(store: Store, num_replicas: int, deadline_s: float, env_procs: list[subprocess.Popen],
                  trainers: list[subprocess.Popen], dp_world_size: int) -> Fleet:
    """Connect to replicas ``0 .. num_replicas - 1`` once each published its address; watch the ``dp_world_size``
    DP ranks' trainer sessions.

    Raises:
        TimeoutError: a replica is not reachable within ``deadline_s``, or a replica this process
            started exited first.
    """
    key, deadline = authkey(store), time.monotonic() + deadline_s
    conns: list[Connection | None] = []
    for replica in range(num_replicas):
        proc = env_procs[replica] if env_procs else None
        conns.append(connect_replica(store, replica, key, deadline, exit_code=lambda p=proc: p and p.poll()))
    return Fleet(conns, env_procs, trainers, [{} for _ in conns], trainer_watch=TrainerWatch(store, dp_world_size))


def stop_fleet(fleet: Fleet, collect: Callable[[float], None], *, failed: bool) -> None:
    """Ask every replica to stop and collect its last results until its connection ends (late groups are
    discarded by the replicas or queued for the orchestrator's shutdown); wait for the processes this
    process started (trainers are killed if the run failed).

    ``collect(timeout_s)``: take what arrived within that many seconds (``job.dispatch.Dispatcher.collect``).
    """
    fleet.stopping = True
    for replica in fleet.live():
        fleet.send(replica, None)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while fleet.live() and time.monotonic() < deadline:
        collect(0.5)
    for replica in fleet.live():
        fleet.close(replica)
    for proc in fleet.env_procs:
        _wait_or_kill(proc, STOP_TIMEOUT_S)
    for proc in fleet.trainers:
        if failed:
            proc.kill()
        proc.wait(timeout=120)


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class TrainerWatch:
    """Which trainer ranks died, by the heartbeats of their ledger sessions (``trainer_dp<r>``), wherever they run.

    A session counts once its heartbeat was seen changing, or once it appeared after the watch's first
    listing (so dead sessions of an earlier life of the run never do); from then on it is dead when
    ``SessionWatch`` says so, unless it closed (a clean end). One look per ``heartbeat_interval_s``: a
    listing of the heartbeats until every DP rank has a session that counts, and one read per session.
    """

    def __init__(self, store: Store, dp_world_size: int):
        self.store, self.actors = store, {trainer_actor(r) for r in range(dp_world_size)}
        self.sessions: set[tuple[str, str]] | None = None  # None until the first listing
        self.new: set[tuple[str, str]] = set()
        self.watch = SessionWatch(store)
        self.next_look_s = 0.0

    def dead(self) -> list[str]:
        """``<actor> (<why>)`` of every trainer session that counts and is dead by now (none between looks)."""
        now = time.monotonic()
        if now < self.next_look_s:
            return []
        self.next_look_s = now + self.store.config.heartbeat_interval_s
        counted = self.watch.seen_live | self.new
        if self.sessions is None or {actor for actor, _ in counted} != self.actors:
            keys = self.store.list_prefix(HEARTBEATS_PREFIX)
            listed = {s for s in map(parse_heartbeat_key, keys) if s and s[0] in self.actors}
            self.new |= listed - self.sessions if self.sessions is not None else set()
            self.sessions = listed | (self.sessions or set())
        dead = self.watch.dead(sorted(self.sessions))
        counted = self.watch.seen_live | self.new
        return [f"{actor} ({why})" for (actor, session), why in sorted(dead.items())
                if why != CLOSED and (actor, session) in counted]
