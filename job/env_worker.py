"""Env-server replicas: sample groups with the MoE policy and keep their side channels.

Each replica is its own process (``refpipe env-server RUN_URI --replica I``, on any
node that reaches the run). It takes ``GroupRequest``s from the orchestrator over a
``multiprocessing.connection`` (authenticated with the run's key), loads the newest published
weights, samples ``group_size`` branches of one task problem, keeps each branch's arrays
through refpipe and sends back ``Episode``s that carry only ``PayloadRef``s. A group
finished after the orchestrator asked the replicas to stop never reaches it: the replica
discards its chunks itself.

A group whose keep fails with a store error (after the store's retries) does not end the
worker: it discards the branches of the group it kept and answers ``failed``; the launcher
re-sends the group as a new attempt, whose branch ids (``<group>-a<attempt>-<i>``) never
collide with an earlier attempt's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener

import torch

from refpipe.job.config import RunConfig
from refpipe.job.report import peak_rss_bytes
from refpipe.job.resume import refuse_finished
from refpipe.job.roles import authkey, exit_with_launcher, open_run
from refpipe.job.weights import latest_version, load_weights
from refpipe.job.workload.model import EOS_ID, MoELM
from refpipe.job.workload.rollout import SampledBranch, sample_branches
from refpipe.job.workload.task import Problem, make_problems, reward
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.samples import BranchResult, Episode
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import ConfigError, StorageError
from refpipe.storage.layout import address_key, env_worker_actor
from refpipe.storage.ledger import Ledger
from refpipe.trainer.pause import pause_point

ENV_NAME = "reverse"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRequest:
    """Sample one group: ``group_size`` branches of problem ``problem_index``."""

    request_id: int
    group_id: str
    problem_index: int
    is_eval: bool = False
    attempt: int = 0
    """0 for the first send; +1 per re-send (a worker died or the group failed): part of every branch id."""


@dataclass(frozen=True)
class GroupResult:
    """What a worker sends back for one request."""

    worker: int
    request_id: int
    episodes: list[Episode]
    policy_version: int
    kept_chunks: int
    kept_bytes: int
    discarded: int = 0
    """Chunks the worker discarded itself (stopping, or the group failed: it never reaches the orchestrator)."""
    failed: str | None = None
    """Why the group failed (a store error while keeping it; nothing of it is kept), else None."""
    peak_rss_bytes: int = field(default_factory=peak_rss_bytes)
    """The worker process's peak RSS when it sent this result (for ``summary.json``)."""


def serve_replica(run_uri: str, replica: int, host: str, s3_endpoint_url: str | None = None) -> None:
    """``refpipe env-server``: one env-server replica of the run at ``run_uri``, until stopped.

    Opens the run (``job.roles.open_run``) and the replica's ledger session, binds a
    ``multiprocessing.connection.Listener`` on ``host`` (port chosen by the OS), and only then
    publishes ``envs/<replica>.address``; serves the first orchestrator that authenticates with
    the run's auth key until it sends ``None`` or goes away; closes the ledger session, then the
    connection (so the orchestrator's end-of-file means the session is closed).

    Raises:
        ConfigError: not a run, a finished run (``job.resume.refuse_finished``), or ``replica`` not in
            ``0 .. job.num_env_workers - 1``.
    """
    started_by_launcher = exit_with_launcher()
    torch.set_num_threads(1)
    # on its own: a startup line, then progress (the launcher's progress view shows a local run's progress instead)
    logging.basicConfig(level=logging.WARNING if started_by_launcher else logging.INFO,
                        format=f"[env-server {replica}] %(message)s")
    cfg, store = open_run(run_uri, s3_endpoint_url)
    if not 0 <= replica < cfg.job.num_env_workers:
        raise ConfigError(f"--replica {replica}: expected 0 .. {cfg.job.num_env_workers - 1} "
                          f"(job.num_env_workers = {cfg.job.num_env_workers})")
    key = authkey(store)
    refuse_finished(store, cfg)
    ledger = Ledger(store, env_worker_actor(replica))
    with Listener((host, 0), authkey=key) as listener:
        address = {"host": host, "port": listener.address[1], "pid": os.getpid(), "hostname": socket.gethostname()}
        store.put(address_key(replica), json.dumps(address).encode())
        log.info("replica %d of run %s listening on %s:%d (actor %s, session %s, pid %d; replicas 0..%d); address in "
                 "%s", replica, store.prefix.uri, host, listener.address[1], ledger.actor, ledger.session, os.getpid(),
                 cfg.job.num_env_workers - 1, store.uri(address_key(replica)))
        conn = _accept(listener)
        log.info("orchestrator connected from %s", _peer(listener))
    with conn:
        served = serve(conn, cfg, store, ledger, replica)
        ledger.close()
    log.info("stopped: %s", served.line())


def _peer(listener: Listener) -> str:
    """The orchestrator's address as ``host:port`` (``Listener.last_accepted``)."""
    peer = listener.last_accepted
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


@dataclass
class Served:
    """What a replica did so far (its progress lines)."""

    groups: int = 0
    failed: int = 0
    kept_chunks: int = 0
    kept_bytes: int = 0
    discarded: int = 0
    version: int = -1

    def add(self, result: "GroupResult") -> None:
        self.groups += 1
        self.failed += bool(result.failed)
        self.kept_chunks += result.kept_chunks
        self.kept_bytes += result.kept_bytes
        self.discarded += result.discarded
        self.version = result.policy_version

    def line(self) -> str:
        return (f"{self.groups} groups served ({self.failed} failed), {self.kept_chunks} chunks kept "
                f"({self.kept_bytes / 2**20:.2f} MiB), {self.discarded} discarded, weights version {self.version}")


def _accept(listener: Listener) -> Connection:
    """The first connection that authenticates (a wrong key is logged and refused)."""
    while True:
        try:
            return listener.accept()
        except (AuthenticationError, OSError) as e:
            log.warning("refused a connection: %s", e)


def serve(conn: Connection, cfg: RunConfig, store, ledger: Ledger, replica: int) -> Served:
    """Answer ``GroupRequest``s in order until a ``None`` request or end-of-file; return what was served.

    A group finished once the orchestrator asked to stop (or went away) never reaches it: its
    chunks are discarded here, and the discard is reported when the orchestrator still listens.
    Logs a progress line (``Served.line``) every ``orchestrator.groups_per_step`` groups (about one per step).
    """
    keeper = Keeper(store, ledger, cfg.fields, cfg.storage)
    model, version = MoELM(cfg.model).eval(), -1
    pending: deque[GroupRequest] = deque()
    served = Served()
    while True:
        request = pending.popleft() if pending else _recv(conn)
        if request is None:
            return served
        version = _refresh_weights(store, model, version)
        result = run_group(model, keeper, cfg, request, worker=replica, version=version)
        if _drain(conn, pending) or not _send(conn, result):
            keeper.discard(_refs(result.episodes), reason="env server stopping: "
                           f"group {request.group_id} will never reach the orchestrator")
            result = GroupResult(replica, request.request_id, [], version, result.kept_chunks, result.kept_bytes,
                                 discarded=len(result.episodes) + result.discarded)
            _send(conn, result)
            served.add(result)
            return served
        served.add(result)
        if served.groups % cfg.orchestrator.groups_per_step == 0:
            log.info("%s", served.line())


def _recv(conn: Connection) -> GroupRequest | None:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _send(conn: Connection, result: GroupResult) -> bool:
    try:
        conn.send(result)
        return True
    except OSError:
        return False


def _drain(conn: Connection, pending: deque) -> bool:
    """Queue every request already sent; True once a stop (``None``) or end-of-file is among them."""
    try:
        while conn.poll(0):
            request = conn.recv()
            if request is None:
                return True
            pending.append(request)
    except (EOFError, OSError):
        return True
    return False


def _refresh_weights(store, model: MoELM, version: int) -> int:
    newest = latest_version(store)
    if newest > version:
        load_weights(store, model, newest)
    return max(newest, version)


def run_group(model: MoELM, keeper: Keeper, cfg: RunConfig, request: GroupRequest, *, worker: int,
              version: int) -> GroupResult:
    """Sample and keep one group; each branch becomes a one-branch episode."""
    problem = make_problems(cfg.task, 1, index=request.problem_index + (10**6 if request.is_eval else 0))[0]
    n = cfg.orchestrator.group_size
    seed = cfg.job.seed * 1_000_003 + request.request_id
    branches = sample_branches(model, [problem.prompt_ids] * n, cfg.sampling, seed=seed)
    episodes: list[Episode] = []
    nbytes = 0
    for i, sampled in enumerate(branches):
        try:
            ref = keeper.keep(Branch(len(sampled.prompt_ids), len(sampled.completion_ids), sampled.fields(),
                                     branch_id=f"{request.group_id}-a{request.attempt}-{i}"))
        except StorageError as e:
            log.warning("group %s attempt %d: keep of branch %d failed: %s", request.group_id, request.attempt, i, e)
            keeper.discard(_refs(episodes),
                           reason=f"env server: group {request.group_id} attempt {request.attempt} failed: {e}")
            return GroupResult(worker, request.request_id, [], version, len(episodes), nbytes,
                               discarded=len(episodes), failed=f"{type(e).__name__}: {e}")
        nbytes += ref.nbytes
        pause_point("keep", request.request_id)
        episodes.append(_episode(request, i, problem, sampled, ref, cfg, version))
    return GroupResult(worker, request.request_id, episodes, version, len(episodes), nbytes)


def _refs(episodes: list[Episode]) -> list[PayloadRef]:
    """The kept chunk of each one-branch episode (every branch here was kept: none lacks a ref)."""
    return [ref for episode in episodes if (ref := episode.branches[0].ref) is not None]


def _episode(request: GroupRequest, i: int, problem: Problem, sampled: SampledBranch, ref, cfg: RunConfig,
             version: int) -> Episode:
    """A one-branch episode; a completion cut at max length without EOS is kept but not trained
    (overlong filtering), so its chunk takes the orchestrator's ``untrained`` path."""
    branch = BranchResult(prompt_ids=sampled.prompt_ids, completion_ids=sampled.completion_ids,
                          inference_logprobs=sampled.logprobs, temperature=cfg.sampling.temperature,
                          policy_version=version, ref=ref,
                          trainable=bool(sampled.completion_ids[-1] == EOS_ID))
    return Episode(episode_id=f"{request.group_id}-{i}", group_id=request.group_id, env_name=ENV_NAME,
                   reward=reward(sampled.completion_ids, problem.target_ids), branches=[branch],
                   is_eval=request.is_eval)



