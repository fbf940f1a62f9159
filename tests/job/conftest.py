"""Fixtures of the job tests: small models, and packing of sampled branches the way a trainer does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pytest
import torch

from refpipe.job.workload.model import ModelConfig, MoELM
from refpipe.job.workload.rollout import SampledBranch


class Packed(NamedTuple):
    """Branches concatenated into one micro batch."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [N + 1] int32
    routed_experts: torch.Tensor  # [T, L, k] uint8
    completion_rows: torch.Tensor  # [sum C] int64 position whose logits predict each completion token
    completion_ids: torch.Tensor  # [sum C] int64
    logprobs: torch.Tensor  # [sum C] float32 inference logprobs
    topk_ids: torch.Tensor  # [sum C, k] int32
    topk_logprobs: torch.Tensor  # [sum C, k] float32


def pack_branches(branches: Sequence[SampledBranch]) -> Packed:
    """Pack branches in order; completion row r of a branch starting at s maps to position s + P + r - 1."""
    seqs = [np.concatenate([b.prompt_ids, b.completion_ids]) for b in branches]
    lengths = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.cat([int(cu[i]) + len(b.prompt_ids) - 1 + torch.arange(len(b.completion_ids))
                      for i, b in enumerate(branches)])
    cat = lambda name: torch.as_tensor(np.concatenate([getattr(b, name) for b in branches]))  # noqa: E731
    return Packed(
        input_ids=torch.as_tensor(np.concatenate(seqs), dtype=torch.int64),
        position_ids=torch.cat([torch.arange(n) for n in lengths.tolist()]),
        cu_seqlens=cu.to(torch.int32), routed_experts=cat("routed_experts"), completion_rows=rows,
        completion_ids=cat("completion_ids").long(), logprobs=cat("logprobs"),
        topk_ids=cat("topk_ids"), topk_logprobs=cat("topk_logprobs"),
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes on a shared 2-core machine: intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pack():
    """``pack_branches``: [SampledBranch] -> Packed."""
    return pack_branches


@pytest.fixture(scope="session")
def model_cfg() -> ModelConfig:
    """The default model config (2 layers, 8 experts, top-2)."""
    return ModelConfig()


@pytest.fixture
def model(model_cfg) -> MoELM:
    """A freshly initialised default model (seed 0)."""
    return MoELM(model_cfg)
