"""Helpers of the checkpoint rows of the store fault matrices: a one-rank world in the test process, a tiny trained
model saved as a checkpoint, and a bitwise comparison of what loads back."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from refpipe.storage.checkpoints import newest_checkpoint
from refpipe.storage.layout import checkpoint_key
from refpipe.trainer.checkpoint import apply_training_state, load_checkpoint, save_checkpoint, training_state

STEP, VERSION = 3, 4
"""The checkpoint every case writes: of step 3, policy version 4."""
FILES = [f"{checkpoint_key(STEP)}/{name}" for name in (".metadata", "__0_0.distcp", "commit.json")]
"""Its keys: DCP's metadata, rank 0's share, refpipe's commit marker."""


@contextlib.contextmanager
def one_rank_world():
    """A gloo world of one rank in this process (an in-process ``HashStore``: no sockets); yields its group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def trained() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    """A ``Linear(3, 2)`` after one Adam step (moments and step count set)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(store, group, model, optimizer) -> str:
    """Save checkpoint ``STEP`` of ``model`` and ``optimizer`` through ``store``; its URI."""
    return save_checkpoint(store, training_state(model, optimizer, step=STEP, policy_version=VERSION), group)


def _tensors(model, optimizer) -> dict[str, torch.Tensor]:
    moments = {f"{name}.{k}": v for name, p in model.named_parameters() for k, v in optimizer.state[p].items()}
    return {**dict(model.named_parameters()), **moments}


def assert_loads_back(store, model, optimizer) -> None:
    """The newest checkpoint (read through ``store``) is ``(STEP, VERSION)`` and loads into a fresh model and
    optimizer bitwise-equal to ``model`` and ``optimizer`` (weights, Adam moments and step count)."""
    info = newest_checkpoint(store)
    assert (info.step, info.policy_version) == (STEP, VERSION), info
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = load_checkpoint(store, STEP, training_state(fresh, fresh_optimizer, step=-1, policy_version=-1))
    apply_training_state(fresh, fresh_optimizer, state)
    assert (state["step"], state["policy_version"]) == (STEP, VERSION)
    got, want = _tensors(fresh, fresh_optimizer), _tensors(model, optimizer)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want), (got, want)
