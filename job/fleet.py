"""The orchestrator's side of the env-server replicas: connections, requests in flight, processes.

One ``multiprocessing.connection`` per replica (``job.roles``), carrying pickled
``GroupRequest``s one way and ``GroupResult``s the other; ``None`` asks a replica to stop. A
replica whose connection ends while the run goes on is dead (its groups are re-sent by the
launcher); once the fleet is stopping, an end of connection only means that replica is done.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from refpipe.job.env_worker import GroupRequest, GroupResult
from refpipe.job.roles import authkey, connect_replica
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

    def live(self) -> list[int]:
        """Replicas whose connection is open."""
        return [w for w, conn in enumerate(self.conns) if conn is not None]

    def send(self, replica: int, request: GroupRequest | None) -> bool:
        """Send one request (``None``: stop); False when the connection is gone."""
        try:
            self.conns[replica].send(request)
            return True
        except OSError:
            return False

    def receive(self, timeout_s: float) -> tuple[list[GroupResult], list[int]]:
        """Results that arrived within ``timeout_s`` and replicas whose connection ended (closed here)."""
        by_conn = {self.conns[w]: w for w in self.live()}
        results, ended = [], []
        for conn in wait(list(by_conn), timeout_s) if by_conn else []:
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
                  trainers: list[subprocess.Popen]) -> Fleet:
    """Connect to replicas ``0 .. num_replicas - 1`` once each published its address.

    Raises:
        TimeoutError: a replica is not reachable within ``deadline_s``, or a replica this process
            started exited first.
    """
    key, deadline = authkey(store), time.monotonic() + deadline_s
    conns = []
    for replica in range(num_replicas):
        proc = env_procs[replica] if env_procs else None
        conns.append(connect_replica(store, replica, key, deadline, alive=lambda p=proc: p is None or p.poll() is None))
    return Fleet(conns, env_procs, trainers, [{} for _ in conns])


def stop_fleet(fleet: Fleet, collect, *, failed: bool) -> None:
    """Ask every replica to stop and collect its last results until its connection ends (late groups are
    discarded by the replicas or queued for the orchestrator's shutdown); wait for the processes this
    process started (trainers are killed if the run failed)."""
    fleet.stopping = True
    for replica in fleet.live():
        fleet.send(replica, None)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while fleet.live() and time.monotonic() < deadline:
        collect(fleet, timeout_s=0.5)
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
