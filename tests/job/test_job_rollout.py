"""Sampling: determinism, field shapes and meaning, and the alignment a trainer relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refpipe.job.workload.model import EOS_ID, token_logprobs
from refpipe.job.workload.rollout import SamplingConfig, sample_branches
from refpipe.job.workload.task import TaskConfig, make_problems
from refpipe.pipeline.fields import FieldsConfig, validate_branch
from refpipe.storage.errors import ConfigError
from tests.job.routing_helpers import ROUTER_MARGIN, router_margin

CFG = SamplingConfig(temperature=0.8, top_p=0.9, max_completion_tokens=12, logprobs_k=8, support_width=16)


def _prompts(num, index=0):
    return [p.prompt_ids for p in make_problems(TaskConfig(), num, index=index)]


@pytest.fixture
def branches(model):
    return sample_branches(model, _prompts(12), CFG, seed=3)


def test_same_seed_same_branches(model, branches):
    again = sample_branches(model, _prompts(12), CFG, seed=3)
    for a, b in zip(branches, again, strict=True):
        for name in ("prompt_ids", "completion_ids", "logprobs", "routed_experts", "topk_ids", "topk_logprobs",
                     "sample_support"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    other = sample_branches(model, _prompts(12), CFG, seed=4)
    assert any(not np.array_equal(a.completion_ids, b.completion_ids) for a, b in zip(branches, other))


def test_fields_have_registry_shapes_and_dtypes(branches):
    fields_cfg = FieldsConfig(num_layers=2, top_k=2, num_experts=8, logprobs_k=8, support_width=16)
    for i, b in enumerate(branches):
        p, c = len(b.prompt_ids), len(b.completion_ids)
        assert b.prompt_ids.dtype == b.completion_ids.dtype == np.int32 and b.logprobs.dtype == np.float32
        assert b.logprobs.shape == (c,) and b.routed_experts.shape == (p + c, 2, 2)
        arrays, _ = validate_branch(b.fields(), fields_cfg, num_prompt_tokens=p, num_completion_tokens=c, what=f"b{i}")
        assert sorted(arrays) == ["routed_experts", "sample_support", "topk_ids", "topk_logprobs"]


def test_completions_stop_at_eos_or_max_length(branches):
    for b in branches:
        c = b.completion_ids
        assert 1 <= len(c) <= CFG.max_completion_tokens
        assert EOS_ID not in c[:-1]
        assert c[-1] == EOS_ID or len(c) == CFG.max_completion_tokens


def test_head_and_support_describe_the_sampler(branches):
    for b in branches:
        support = b.sample_support
        assert (np.diff(b.topk_logprobs, axis=1) <= 0).all()  # most probable first
        assert np.array_equal(support[:, :8][support[:, :8] >= 0], b.topk_ids[support[:, :8] >= 0])
        present = support >= 0
        assert present[:, 0].all() and (present[:, :-1] >= present[:, 1:]).all()  # -1 only at the tail
        assert ((support == b.completion_ids[:, None]).sum(1) == 1).all()  # drawn from the support
        in_head = b.topk_ids == b.completion_ids[:, None]
        assert np.array_equal(b.topk_logprobs[in_head], b.logprobs[in_head.any(1)])


def test_support_is_nucleus_capped_at_width(model):
    greedy = sample_branches(model, _prompts(4), CFG.model_copy(update={"top_p": 1e-6}), seed=0)
    for b in greedy:
        assert (b.sample_support[:, 1:] == -1).all()
        assert np.array_equal(b.completion_ids, b.topk_ids[:, 0])
    capped = sample_branches(model, _prompts(4), CFG.model_copy(update={"top_p": 1.0, "support_width": 3}), seed=0)
    for b in capped:
        assert np.array_equal(b.sample_support, b.topk_ids[:, :3])


def test_recorded_routing_and_logprobs_match_a_forward_without_replay(model, branches):
    """Each branch alone, no replay: the trainer's forward picks the recorded routing and logprobs."""
    for b in branches:
        seq = torch.as_tensor(np.concatenate([b.prompt_ids, b.completion_ids]), dtype=torch.int64)
        with torch.no_grad():
            inputs = (seq, torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32))
            logits, routing = model(*inputs)
        assert router_margin(model, *inputs) > ROUTER_MARGIN  # sampling ran other shapes: ids equal on every CPU
        assert np.array_equal(routing.numpy(), b.routed_experts)
        p = len(b.prompt_ids)
        recomputed = token_logprobs(logits[p - 1 : -1], seq[p:], CFG.temperature)
        assert float((recomputed - torch.as_tensor(b.logprobs)).abs().max()) < 1e-5


def test_packed_replay_aligns_and_shifted_routing_does_not(model, branches, pack):
    batch = pack(branches)

    def max_diff(routed_experts):
        with torch.no_grad():
            logits, _ = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, routed_experts)
        recomputed = token_logprobs(logits[batch.completion_rows], batch.completion_ids, CFG.temperature)
        return float((recomputed - batch.logprobs).abs().max())

    assert max_diff(batch.routed_experts) < 1e-5
    assert max_diff(torch.roll(batch.routed_experts, shifts=1, dims=0)) > 1e-2


def test_prompt_too_long_for_positions(model):
    with pytest.raises(ConfigError, match="max_positions=64"):
        sample_branches(model, [np.zeros(60, dtype=np.int32)], CFG, seed=0)
