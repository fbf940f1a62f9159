"""Trainer checkpoints through ``torch.distributed.checkpoint`` (DCP), published atomically.

Layout under the run prefix::

    checkpoints/step_<N:08d>/__<rank>_0.distcp   each rank's share (DCP, one file per rank)
    checkpoints/step_<N:08d>/.metadata           DCP's coordinator writes it after every rank's share
    checkpoints/step_<N:08d>/commit.json         refpipe's commit marker, written last by rank 0

A checkpoint covering step ``N`` holds every effect of steps ``<= N``: model and optimizer
state, every rank's RNG states, the step and the policy version. It counts only once it has
both DCP's ``.metadata`` and the commit marker; ``storage.checkpoints.newest_checkpoint`` (no torch) skips a
newer one that lacks either (a crash mid-write) with a warning. DCP reads and writes through the run's ``Store``
(``trainer.checkpoint_store``): every file is one exclusive, durable put (write token, retries, error
classification, confinement to the run prefix) on a directory and on S3 alike; ``.metadata`` appears at
once, never renamed into place.

Which ranks call what, in which order: every rank calls ``save_checkpoint`` (collectives:
DCP's plan exchange, an all-reduce of every rank's success, a broadcast of the marker's
success) and ``load_checkpoint`` (DCP's collectives); any rank may call ``newest_checkpoint``.
"""

from __future__ import annotations

import json
import logging
import random
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

from refpipe.storage.errors import CheckpointError
from refpipe.storage.layout import CHECKPOINT_MARKER_NAME, checkpoint_key
from refpipe.storage.store import Store
from refpipe.trainer.pause import pause_point

log = logging.getLogger(__name__)


def _dcp() -> ModuleType:
    """``torch.distributed.checkpoint``, imported on first use: its import is a large share of a process's start
    (the launcher and ``newest_checkpoint`` never need it, a trainer rank only once it saves or loads)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401 -- get_state_dict/set_state_dict below

    return dcp


def _checkpoint_store() -> ModuleType:
    """``trainer.checkpoint_store`` (it imports DCP: on first use, as ``_dcp``)."""
    from refpipe.trainer import checkpoint_store

    return checkpoint_store


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                   policy_version: int) -> dict:
    """The state one checkpoint holds for this rank: model and optimizer (DCP's FQN-keyed state dicts,
    identical on every rank of a replicated model), this rank's RNG states (torch, numpy, Python, under
    ``rng_rank<r>``), ``step`` and ``policy_version``. Every rank calls it before ``save_checkpoint``, and for a
    fresh model and optimizer as the template ``load_checkpoint`` fills (``_state_dicts``)."""
    model_state, optimizer_state = _state_dicts(model, optimizer)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": model_state, "optimizer": optimizer_state, f"rng_rank{dist.get_rank()}": rng,
            "step": step, "policy_version": policy_version}


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts, the optimizer's with every parameter's state (Adam: ``step``,
    ``exp_avg``, ``exp_avg_sq``) even before its first step.

    DCP loads only the keys of the template it is given. A fresh optimizer (a resumed rank's template) has no
    state yet; ``get_state_dict`` materialises it (one step with lr 0 on zero gradients, parameters unchanged)
    only when no parameter holds a gradient, and a trainer may keep zero gradients allocated
    (``job.train_rank.PolicyTrainer``): then the template had no moments, none were loaded, and a resumed Adam
    restarted from zero. So the gradients are set aside around the call. The same rule holds when saving (an
    optimizer that never stepped is saved materialised, and goes on from that state), so saved == loaded.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if not optimizer.state:
        for p in params:
            p.grad = None
    try:
        states: tuple[dict, dict] = _dcp().state_dict.get_state_dict(model, optimizer)
        return states
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def apply_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put a loaded ``training_state`` back: model, optimizer and this rank's RNG states."""
    _dcp().state_dict.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                     optim_state_dict=state["optimizer"])
    rng = state[f"rng_rank{dist.get_rank()}"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def save_checkpoint(store: Store, state: dict, group: dist.ProcessGroup) -> str:
    """Every rank: write ``state`` (from ``training_state``) as the checkpoint of ``state["step"]``; publish it.

    ``group``: the data path's gloo group (``TrainerRank.data_group``): the agreement below all-reduces a CPU
    tensor, which an NCCL default group cannot carry. DCP's own collectives run on the default group.

    DCP writes every rank's share, then its coordinator writes ``.metadata``; the ranks then agree
    that every one of them succeeded (all-reduce), rank 0 writes the commit marker, and rank 0's
    outcome is broadcast, so on return the checkpoint is durable on every rank alike.

    Returns:
        The checkpoint's URI.

    Raises:
        CheckpointError: some rank's write, or the marker, failed (raised on every rank; the
            checkpoint has no marker, so resume skips it).
    """
    step = int(state["step"])
    key = checkpoint_key(step)
    ok, dcp = torch.ones(1, dtype=torch.int32), _dcp()
    try:
        dcp.save(state, storage_writer=_checkpoint_store().StoreWriter(store, key))
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 -- any rank's failure is agreed on first
        log.error("checkpoint of step %d: this rank's write failed: %s", step, e)
        ok.zero_()
    pause_point("checkpoint", step)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() and dist.get_rank() == 0:
        marker = {"step": step, "policy_version": int(state["policy_version"]), "world_size": dist.get_world_size()}
        try:
            store.put(f"{key}/{CHECKPOINT_MARKER_NAME}", json.dumps(marker).encode(), exclusive=True, durable=True)
        except Exception as e:  # noqa: BLE001 -- the other ranks must learn that the marker failed
            log.error("checkpoint of step %d: commit marker failed: %s", step, e)
            ok.zero_()
    dist.broadcast(ok, src=0, group=group)
    if not ok.item():
        raise CheckpointError(f"checkpoint {store.uri(key)} of step {step}: a rank's write or the commit marker "
                              f"failed (see the trainer logs); it is not published")
    return store.uri(key)


def load_checkpoint(store: Store, step: int, state: dict) -> dict:
    """Every rank: load checkpoint ``step`` into ``state`` (a ``training_state`` of the same shapes) in place.

    Returns:
        ``state``, with ``step`` and ``policy_version`` as saved.

    Raises:
        CheckpointError: the checkpoint cannot be read.
    """
    dcp = _dcp()
    try:
        dcp.load(state, storage_reader=_checkpoint_store().StoreReader(store, checkpoint_key(step)))
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 -- CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {store.uri(checkpoint_key(step))}: cannot load: {e}") from e
    return state
