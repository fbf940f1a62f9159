"""One rank of a checkpoint test world: ``python -m tests.trainer.checkpoint_worker <spec.json> <rank>``.

Trains a small linear model one Adam step, saves it as the checkpoint of ``spec["step"]`` (policy
version ``step + 1``), records the parameters, Adam's state and the next RNG draws, scrambles the RNG,
loads the newest complete checkpoint into a fresh model and optimizer, as a resumed trainer rank does
(zero gradients allocated, like ``job.train_rank.PolicyTrainer``), and records the same again, into
``rank<r>.json``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from refpipe.storage.backends import open_store
from refpipe.storage.checkpoints import newest_checkpoint
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import CheckpointError, OutsideRunError
from refpipe.trainer.checkpoint import apply_training_state, load_checkpoint, save_checkpoint, training_state
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.dist import init_process_group, new_data_group


def snapshot(model, optimizer) -> dict:
    return {"weight": model.weight.detach().flatten().tolist(),
            "exp_avg": optimizer.state[model.weight]["exp_avg"].flatten().tolist(),
            "exp_avg_sq": optimizer.state[model.weight]["exp_avg_sq"].flatten().tolist(),
            "adam_step": float(optimizer.state[model.weight]["step"]),
            "grads_allocated": all(p.grad is not None for p in model.parameters()),
            "draws": [torch.rand(2).tolist(), np.random.rand(2).tolist(), [random.random()]]}


def fresh_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with other weights than the trained one, and an Adam with no state yet; zero gradients allocated."""
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def main(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    init_process_group(TrainerConfig(collective_timeout_s=60), rank=rank, world_size=2,
                       init_method=spec["init_method"])
    data_group = new_data_group(TrainerConfig(collective_timeout_s=60))
    store = open_store(StorageConfig(**spec["storage"]))
    torch.manual_seed(rank)  # different RNG streams per rank; the model itself is the same on both
    np.random.seed(rank)
    random.seed(rank)
    model, optimizer = fresh_model_and_optimizer()
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3))
        model.bias.zero_()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    out = {}
    state = training_state(model, optimizer, step=spec["step"], policy_version=spec["step"] + 1)
    try:
        out["uri"] = save_checkpoint(store, state, data_group)
    except CheckpointError as e:
        out["error"] = str(e)
    out["saved"] = snapshot(model, optimizer)
    model, optimizer = fresh_model_and_optimizer()  # a later life: nothing of the first one in memory
    torch.rand(10), np.random.rand(10), random.random()
    try:
        info = newest_checkpoint(store)
    except OutsideRunError as e:  # checkpoints/ is a symlink: the store refuses to list it
        info, out["newest_error"] = None, str(e)
    out["newest"] = None if info is None else [info.step, info.policy_version]
    if info is not None:
        fresh = training_state(model, optimizer, step=-1, policy_version=-1)
        loaded = load_checkpoint(store, info.step, fresh)
        apply_training_state(model, optimizer, loaded)
        out["loaded_step"], out["loaded_version"] = loaded["step"], loaded["policy_version"]
        out["loaded"] = snapshot(model, optimizer)
    Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
