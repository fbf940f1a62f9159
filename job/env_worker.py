"""Env-server worker processes: sample groups with the MoE policy and keep their side channels.

Each worker is its own process (spawned, so s3fs and torch start fresh in it). It
takes ``GroupRequest``s from its own queue, loads the newest published weights,
samples ``group_size`` branches of one task problem, keeps each branch's arrays
through refpipe and sends back ``Episode``s that carry only ``PayloadRef``s.
A group finished after the launcher asked the workers to stop never reaches the
orchestrator: the worker discards its chunks itself.

A group whose keep fails with a store error (after the store's retries) does not end the
worker: it discards the branches of the group it kept and answers ``failed``; the launcher
re-sends the group as a new attempt, whose branch ids (``<group>-a<attempt>-<i>``) never
collide with an earlier attempt's.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
from dataclasses import dataclass, field

import torch
from refpipe.job.config import RunConfig
from refpipe.job.model import EOS_ID, MoELM
from refpipe.job.report import peak_rss_bytes
from refpipe.job.rollout import SampledBranch, sample_branches
from refpipe.job.task import Problem, make_problems, reward
from refpipe.job.weights import latest_version, load_weights
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.samples import BranchResult, Episode
from refpipe.storage.backends import open_store
from refpipe.storage.errors import StorageError
from refpipe.storage.layout import env_worker_actor
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


def env_worker_main(config_json: str, worker: int, requests: mp.Queue, results: mp.Queue, stop: mp.Event) -> None:
    """Process entry: serve group requests until a ``None`` request, ``stop`` is set, or the launcher is gone.

    Ctrl-C is the launcher's to handle (it sets ``stop``); a worker whose launcher died (SIGKILL)
    exits at its next look, leaving its chunks to ``refpipe sweep --stopped``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launcher = os.getppid()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    cfg = RunConfig.model_validate_json(config_json)
    store = open_store(cfg.storage)
    ledger = Ledger(store, env_worker_actor(worker))
    keeper = Keeper(store, ledger, cfg.fields, cfg.storage)
    model, version = MoELM(cfg.model).eval(), -1
    while not stop.is_set() and os.getppid() == launcher:
        try:
            request = requests.get(timeout=0.2)
        except queue.Empty:
            continue
        if request is None:
            break
        version = _refresh_weights(store, model, version)
        result = run_group(model, keeper, cfg, request, worker=worker, version=version)
        if stop.is_set():
            keeper.discard([e.branches[0].ref for e in result.episodes], reason="env server stopping: "
                           f"group {request.group_id} will never reach the orchestrator")
            results.put(GroupResult(worker, request.request_id, [], version, result.kept_chunks, result.kept_bytes,
                                    discarded=len(result.episodes)))
            break
        results.put(result)
    ledger.close()


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
    episodes, nbytes = [], 0
    for i, sampled in enumerate(branches):
        try:
            ref = keeper.keep(Branch(len(sampled.prompt_ids), len(sampled.completion_ids), sampled.fields(),
                                     branch_id=f"{request.group_id}-a{request.attempt}-{i}"))
        except StorageError as e:
            log.warning("group %s attempt %d: keep of branch %d failed: %s", request.group_id, request.attempt, i, e)
            keeper.discard([episode.branches[0].ref for episode in episodes],
                           reason=f"env server: group {request.group_id} attempt {request.attempt} failed: {e}")
            return GroupResult(worker, request.request_id, [], version, len(episodes), nbytes,
                               discarded=len(episodes), failed=f"{type(e).__name__}: {e}")
        nbytes += ref.nbytes
        pause_point("keep", request.request_id)
        episodes.append(_episode(request, i, problem, sampled, ref, cfg, version))
    return GroupResult(worker, request.request_id, episodes, version, len(episodes), nbytes)


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



