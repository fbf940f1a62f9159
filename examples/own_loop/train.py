"""A trainer rank of your own loop, started once per rank by torchrun:
``python -m torch.distributed.run --nproc-per-node 2 train.py WORK_DIR LIFE``.

The loop is yours: pull each step from refpipe (``TrainerRank.steps``), forward/backward every micro batch
with the advantages your orchestrator computed, all-reduce the gradients, take the optimizer step, write your
checkpoint, and only then ``release()`` the step (refpipe deletes the chunks this DP rank owns). A later life
restores your checkpoint and asks refpipe which steps to train (``TrainerRank.resume_plan``): none is trained
twice, none is lost.

What each rank trained is appended to ``WORK_DIR/trained_life<LIFE>_rank<r>.jsonl`` (one line per micro batch:
step, DP rank, index, the sample ids and the advantage each sample got), for ``run.py`` to count. In life 1,
DP rank 1 stops before releasing ``crash_step`` (after DP rank 0 released it) and waits for ``run.py`` to
SIGKILL it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from refpipe import (
    FieldsConfig,
    StorageConfig,
    TrainerConfig,
    TrainerRank,
    TrainingStep,
    init_process_group,
    open_store,
)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, opened: TrainingStep) -> list[dict]:
    """One optimizer step on this rank's micro batches: a policy-gradient loss weighted by the caller's
    advantages, gradients averaged over the world. Returns what it trained, one record per micro batch."""
    optimizer.zero_grad()
    trained = []
    for mb in opened.batches:
        ids, mask, adv = mb.streams["input_ids"], mb.streams["loss_mask"], mb.streams["advantages"]
        logp = torch.log_softmax(model(ids[:-1]), -1).gather(1, ids[1:, None])[:, 0]
        (-(logp * adv[1:] * mask[1:]).sum() / max(1, int(mask.sum()))).backward()  # a dropped one adds 0
        if not mb.dropped:
            trained.append(trained_record(opened, mb))
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    return trained


def trained_record(opened: TrainingStep, mb) -> dict:
    """Which samples a micro batch holds (their branch ids, through the step's ref table) and the advantage on
    each one's last token."""
    ends = mb.cu_seqlens[1:].tolist()
    ids, advantages = [], []
    for seq, end in zip(mb.record.sequences, ends):
        if seq.ref is not None and not seq.borrowed:
            ids.append(opened.header.refs[seq.ref].branch_id)
            advantages.append(float(mb.streams["advantages"][end - 1]))
    return {"step": opened.step, "dp_rank": mb.record.dp_rank, "index": mb.record.index, "samples": ids,
            "advantages": advantages}


def main(work: Path, life: int) -> None:
    spec = json.loads((work / "spec.json").read_text())
    storage, fields = StorageConfig(**spec["storage"]), FieldsConfig(**spec["fields"])
    # your checkpoint is durable before every release, so deleting right after it loses nothing (docs/release.md)
    config = TrainerConfig(step_timeout_s=60, step_poll_s=0.1, collective_timeout_s=60, release="after_step")
    init_process_group(config, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = TrainerRank(open_store(storage), fields, storage, config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(spec["vocab"], 16), torch.nn.Linear(16, spec["vocab"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = work / "checkpoint.pt"
    plan = None
    if life > 1:  # restore your own checkpoint, then ask which steps to train
        state = torch.load(checkpoint) if checkpoint.exists() else {"step": -1}
        if "model" in state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        plan = rank.resume_plan(checkpoint_step=state["step"])
        if dist.get_rank() == 0:
            (work / f"plan_life{life}.json").write_text(json.dumps(
                {"checkpoint_step": plan.checkpoint_step, "start_step": plan.start_step, "skipped": plan.skipped,
                 "replayed": plan.replayed}))
    record = open(work / f"trained_life{life}_rank{dist.get_rank()}.jsonl", "a")
    for opened in rank.steps(spec["num_steps"], resume=plan):
        for line in train_step(model, optimizer, opened):
            record.write(json.dumps(line) + "\n")
        record.flush()
        if dist.get_rank() == 0:  # your checkpoint, durable before any rank releases the step
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": opened.step},
                       work / "checkpoint.tmp")
            os.replace(work / "checkpoint.tmp", checkpoint)
        dist.barrier()
        if life == 1 and opened.step == spec["crash_step"] and rank.topology.dp_rank == 1:
            (work / "paused").write_text(str(os.getpid()))
            time.sleep(3600)  # run.py SIGKILLs this rank once DP rank 0 has released the step
        opened.release()
    rank.finish()
    rank.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
