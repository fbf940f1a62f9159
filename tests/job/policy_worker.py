"""One rank of a 2-rank gloo world running the main job's policy update:
``python -m tests.job.policy_worker <spec.json> <rank>``.

For each scenario of the spec, a fresh model and one policy update; the scenario says what each rank
trains: ``"live"`` (one fetched micro batch), ``"dropped"`` (the shape-only stand-in of a micro batch it
could not fetch) or nothing. Writes ``<scenario>_rank<r>.npz``: every parameter after the optimizer
step, and the reduced step statistics.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from refpipe.job.config import RunConfig
from refpipe.job.train_rank import PolicyTrainer
from refpipe.job.workload.model import MoELM
from refpipe.pipeline.fields import spread_expert_rows
from refpipe.pipeline.step_header import MicroBatchRecord, SequenceRecord
from refpipe.trainer.assemble import AssembledMicroBatch, FieldBatch, assemble_dropped_micro_batch
from refpipe.trainer.dist import init_process_group
from refpipe.trainer.layout import pad_streams, padded_cu_seqlens
from refpipe.trainer.tensors import to_torch

SEQ_LEN, P, C = 32, 4, 6


def micro_batch(cfg: RunConfig, dp_rank: int, kind: str) -> AssembledMicroBatch:
    """One micro batch of one sequence (P prompt + C completion tokens), fetched or dropped."""
    record = MicroBatchRecord(dp_rank=dp_rank, index=0, sequences=[SequenceRecord(num_tokens=P + C, env_name="t",
                                                                                  ref=0)],
                              num_padding_tokens=SEQ_LEN - P - C, has_routing=True)
    rng = np.random.default_rng(dp_rank)
    streams = {"input_ids": rng.integers(0, 256, P + C).astype(np.int32),
               "loss_mask": np.arange(P + C) >= P, "advantages": np.where(np.arange(P + C) >= P, 1.0, 0.0)
               .astype(np.float32), "inference_logprobs": np.full(P + C, -1.0, np.float32),
               "position_ids": np.arange(P + C, dtype=np.int32), "temperatures": np.ones(P + C, np.float32)}
    if kind == "dropped":
        return assemble_dropped_micro_batch(record, streams, seq_len=SEQ_LEN, fields=cfg.fields, token_rows=None)
    k, m = cfg.sampling.logprobs_k, cfg.model
    padded = spread_expert_rows(SEQ_LEN, m.num_layers, m.top_k, m.num_experts, np.dtype(np.uint8))
    row_ids = np.full(SEQ_LEN, -1, np.int64)
    row_ids[P - 1 : P + C - 1] = np.arange(C)
    cu = np.array([0, C], np.int32)
    fields = {"routed_experts": FieldBatch(padded[: P + C], record.cu_seqlens(), padded=padded),
              "topk_ids": FieldBatch(rng.integers(0, 256, (C, k)).astype(np.int32), cu, row_ids=row_ids),
              "topk_logprobs": FieldBatch(np.full((C, k), -3.0, np.float32), cu, row_ids=row_ids)}
    return AssembledMicroBatch(record, SEQ_LEN, pad_streams(streams, SEQ_LEN), padded_cu_seqlens(record, SEQ_LEN),
                               fields)


def main(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    cfg = RunConfig()
    init_process_group(cfg.trainer.model_copy(update={"collective_timeout_s": 30.0}), rank=rank, world_size=2,
                       init_method=spec["init_method"])
    for name, ranks in spec["scenarios"].items():
        model = MoELM(cfg.model)
        policy = PolicyTrainer(cfg, model)
        policy([to_torch(micro_batch(cfg, rank, kind)) for kind in ranks[rank]])
        params = {n: p.detach().numpy() for n, p in model.named_parameters()}
        np.savez(Path(spec["out_dir"]) / f"{name}_rank{rank}.npz", **params,
                 stats=np.array(json.dumps(asdict(policy.stats))))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
