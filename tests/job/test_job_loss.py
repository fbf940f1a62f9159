"""The policy loss: exact values on hand-made rows, masking, and a short RL smoke through replay."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from refpipe.job.workload.loss import policy_loss
from refpipe.job.workload.rollout import SamplingConfig, sample_branches
from refpipe.job.workload.task import TaskConfig, make_problems, reward, warm_start

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 0.0, 0.0]])
TOKENS = torch.tensor([0, 3, 1])
LOGP = torch.log_softmax(LOGITS, dim=-1)
HEAD_IDS = torch.tensor([[0, 1], [0, 1], [1, 0]])


def _loss(inference_logprobs, advantages, mask=(True, True, True), head_logprobs=None, **kw):
    head = LOGP.gather(-1, HEAD_IDS) if head_logprobs is None else head_logprobs
    return policy_loss(LOGITS, TOKENS, inference_logprobs, torch.tensor(advantages), torch.tensor(mask),
                       HEAD_IDS, head, temperature=1.0, **kw)


def test_on_policy_loss_is_minus_the_advantage_sum():
    on_policy = LOGP.gather(-1, TOKENS[:, None])[:, 0]
    terms = _loss(on_policy, [1.0, -0.5, 2.0])
    assert terms.num_tokens == 3 and terms.clipped == 0
    assert terms.pg_sum == pytest.approx(-2.5, abs=1e-6) and terms.kl_sum == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(terms.logprobs, on_policy)


def test_ratio_clipping_takes_the_pessimistic_side():
    on_policy = LOGP.gather(-1, TOKENS[:, None])[:, 0]
    shift = torch.tensor([math.log(2.0), math.log(2.0), -math.log(2.0)])  # ratios 2, 2, 0.5
    terms = _loss(on_policy - shift, [1.0, -1.0, 1.0], kl_coef=0.0)
    # row 0: min(2, 1.2) -> -1.2; row 1: min(-2, -1.2) -> +2; row 2: min(0.5, 0.8) -> -0.5
    assert terms.pg_sum == pytest.approx(-1.2 + 2.0 - 0.5, abs=1e-5)
    assert terms.clipped == 1
    assert float(terms.loss_sum) == pytest.approx(terms.pg_sum, abs=1e-6)


def test_kl_to_the_inference_head():
    on_policy = LOGP.gather(-1, TOKENS[:, None])[:, 0]
    head = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]))
    terms = _loss(on_policy, [0.0, 0.0, 0.0], head_logprobs=head, kl_coef=0.5)
    pi = torch.log_softmax(LOGP.gather(-1, HEAD_IDS), dim=-1)
    expected = float((0.5 * (math.log(0.5) - pi)).sum())
    assert terms.kl_sum == pytest.approx(expected, abs=1e-6) and expected > 0.1
    assert float(terms.loss_sum) == pytest.approx(0.5 * expected, abs=1e-6)


def test_masked_rows_contribute_nothing_even_when_garbage():
    head = LOGP.gather(-1, HEAD_IDS).clone()
    head[1] = float("-inf")
    inference = LOGP.gather(-1, TOKENS[:, None])[:, 0].clone()
    inference[1] = float("nan")
    logits = LOGITS.clone().requires_grad_()
    terms = policy_loss(logits, TOKENS, inference, torch.tensor([1.0, 5.0, 2.0]), torch.tensor([True, False, True]),
                        HEAD_IDS, head, temperature=1.0)
    terms.loss_sum.backward()
    assert terms.num_tokens == 2 and terms.pg_sum == pytest.approx(-3.0, abs=1e-6)
    assert torch.isfinite(logits.grad).all() and bool((logits.grad[1] == 0).all())


def test_rl_steps_through_replay_are_aligned_and_move_the_policy(model, pack):
    """Three synchronous GRPO steps: replayed logprobs match inference, loss finite, weights change."""
    task, sampling = TaskConfig(), SamplingConfig(max_completion_tokens=12)
    warm_start(model, task, steps=20)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(3):
        problems = make_problems(task, 4, index=step)
        branches = sample_branches(model, [p.prompt_ids for p in problems for _ in range(4)], sampling, seed=step)
        rewards = np.array([reward(b.completion_ids, problems[i // 4].target_ids) for i, b in enumerate(branches)])
        advantages = (rewards.reshape(4, 4) - rewards.reshape(4, 4).mean(1, keepdims=True)).reshape(-1)
        batch = pack(branches)
        token_adv = torch.as_tensor(np.repeat(advantages, [len(b.completion_ids) for b in branches]),
                                    dtype=torch.float32)
        logits, _ = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.routed_experts)
        terms = policy_loss(logits[batch.completion_rows], batch.completion_ids, batch.logprobs, token_adv,
                            torch.ones_like(token_adv, dtype=torch.bool), batch.topk_ids, batch.topk_logprobs,
                            temperature=sampling.temperature)
        assert float((terms.logprobs - batch.logprobs).abs().max()) < 1e-5
        assert math.isfinite(float(terms.loss_sum.detach())) and terms.num_tokens == len(token_adv)
        opt.zero_grad()
        (terms.loss_sum / terms.num_tokens).backward()
        opt.step()
    assert not torch.equal(before["blocks.1.moe.w_in"], model.state_dict()["blocks.1.moe.w_in"])
