"""Declare your own side-channel fields and carry them from an env server to a trainer rank, byte for byte.

Declares three fields beyond the built-in ones (teacher logprobs and per-token rewards on completion tokens,
an image feature on prompt positions), keeps branches from torch tensors with int32 and int64 routing as
engines emit them, publishes a step with the ``Orchestrator``, trains it as the only rank of a gloo world
(``TrainerRank``), checks that every fetched row holds the bytes kept, releases, audits the finished run
and prints one JSON line of what it measured. docs/fields.md explains each declaration.

    python examples/custom_fields.py [ROOT]     # ROOT: a directory or s3://bucket/prefix (default: a temp dir)
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile

import numpy as np
import torch

from refpipe import (
    Branch,
    BranchResult,
    Episode,
    FieldDecl,
    FieldsConfig,
    Keeper,
    Ledger,
    Orchestrator,
    OrchestratorConfig,
    StorageConfig,
    TrainerConfig,
    TrainerRank,
    ValueChecks,
    init_process_group,
    open_store,
)
from refpipe.pipeline.audit import audit
from refpipe.pipeline.step_file import StepFile

P, C, IMAGE_DIM = 6, 10, 16
DECLARED = (
    FieldDecl(name="teacher_logprobs", dtypes=["float32"], domain="completion",
              checks=ValueChecks(finite=True, high=0.0)),
    FieldDecl(name="token_rewards", dtypes=["float32"], domain="completion", checks=ValueChecks(finite=True)),
    FieldDecl(name="image_features", dtypes=["float16"], shape=[IMAGE_DIM], domain="prompt",
              checks=ValueChecks(finite=True)),
)
FIELDS = FieldsConfig(num_layers=2, top_k=2, num_experts=8, declare=DECLARED, required=["teacher_logprobs"])


def sampled_branch(i: int) -> tuple[dict[str, object], np.ndarray, np.ndarray]:
    """What an engine hands back for branch ``i``: torch tensors, routing as int32 or int64 (torch.topk)."""
    gen = torch.Generator().manual_seed(i)
    routing = torch.rand(P + C, 2, 8, generator=gen).topk(2, dim=-1).indices  # int64 [T, layers, top_k]
    fields = {
        "routed_experts": routing.to(torch.int32) if i % 2 else routing,
        "teacher_logprobs": -torch.rand(C, generator=gen),
        "token_rewards": torch.randn(C, generator=gen),
        "image_features": torch.randn(P, IMAGE_DIM, generator=gen).to(torch.float16),
    }
    prompt = torch.randint(0, 1000, (P,), generator=gen, dtype=torch.int32).numpy()
    completion = torch.randint(0, 1000, (C,), generator=gen, dtype=torch.int32).numpy()
    return fields, prompt, completion


def keep_and_publish(storage: StorageConfig, num_groups: int, group_size: int) -> dict[str, dict[str, np.ndarray]]:
    """Keep every branch (env worker), publish step 0 (orchestrator); return branch id -> the stored arrays."""
    store = open_store(storage)
    ledger = Ledger(store, "env_worker_0")
    keeper = Keeper(store, ledger, FIELDS, storage)
    orchestrator = Orchestrator(OrchestratorConfig(seq_len=64, dp_world_size=1, groups_per_step=num_groups,
                                                   group_size=group_size), store, fields=FIELDS)
    kept = {}
    for g in range(num_groups):
        for j in range(group_size):
            i = g * group_size + j
            fields, prompt, completion = sampled_branch(i)
            ref = keeper.keep(Branch(P, C, fields, branch_id=f"b{i}"))
            kept[ref.branch_id] = {name: np.asarray(v).astype(ref.arrays[name].dtype) for name, v in fields.items()}
            branch = BranchResult(prompt, completion, np.full(C, -0.5, np.float32), temperature=1.0,
                                  policy_version=0, ref=ref)
            orchestrator.submit(Episode(f"e{i}", f"g{g}", "custom_env", reward=float(j % 2), branches=[branch]))
    orchestrator.build_step(0)
    orchestrator.shutdown()
    ledger.close()
    return kept


def train_and_compare(storage: StorageConfig, kept: dict[str, dict[str, np.ndarray]]) -> bool:
    """Train step 0 as the only trainer rank; True when every fetched row equals the kept bytes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = TrainerConfig(step_timeout_s=60, release="after_step")
    init_process_group(config, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    store = open_store(storage)
    rank = TrainerRank(store, FIELDS, storage, config)
    refs = StepFile.read(store, 0).header.refs
    equal = []

    def train(batches):
        for mb in batches:
            for s, seq in enumerate(mb.record.sequences):
                if seq.ref is None or seq.borrowed:
                    continue
                for name, want in kept[refs[seq.ref].branch_id].items():
                    got = mb.fields[name]
                    lo, hi = int(got.cu_seqlens[s]), int(got.cu_seqlens[s + 1])
                    equal.append(got.values[lo:hi].numpy().tobytes() == want.tobytes())

    rank.run_step(0, train)
    rank.finish()
    rank.close()
    torch.distributed.destroy_process_group()
    return bool(equal) and all(equal)


def main(root: str) -> dict:
    storage = StorageConfig(root=root, run_id="custom-fields")
    kept = keep_and_publish(storage, num_groups=2, group_size=4)
    byte_equal = train_and_compare(storage, kept)
    report = audit(open_store(storage), finished=True)
    return {"declared_fields": [d.name for d in FIELDS.declare], "byte_equal": byte_equal,
            "audit_clean": not report.violations and report.outstanding == 0 and report.leaked == 0,
            "kept": report.kept, "deleted": report.deleted}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else tmp)))
