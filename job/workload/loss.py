"""The policy-gradient loss of the main job: GRPO-style clipped token loss + a top-k head KL.

Per completion token ``r`` (logits ``z_r`` [V] at the position that predicts it, sampled
token ``y_r``, advantage ``A_r``, inference logprob ``l_r``, inference head ``topk_ids_r``
/ ``topk_logprobs_r`` [k], temperature ``tau``):

    logp_r  = log_softmax(z_r / tau)[y_r]                      (job.workload.model.token_logprobs)
    rho_r   = exp(logp_r - l_r)                                importance ratio to inference
    pg_r    = -min(rho_r * A_r, clip(rho_r, 1 - eps, 1 + eps) * A_r)
    q_r     = softmax(topk_logprobs_r)                         inference head renormalised over its k ids
    pi_r    = log_softmax(log_softmax(z_r / tau)[topk_ids_r])  current policy renormalised over the same ids
    kl_r    = sum_k q_r[k] * (log q_r[k] - pi_r[k])            KL(inference head || current policy)
    loss    = sum_r mask_r * (pg_r + kl_coef * kl_r)

The KL term keeps the updated policy close to the distribution that sampled the data
on its most probable ids, which is what the fetched top-k head is for.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LossTerms(NamedTuple):
    """Sums over the masked completion tokens of one micro batch (divide by a global token count)."""

    loss_sum: torch.Tensor
    """Scalar float32 with grad: sum of ``pg_r + kl_coef * kl_r``."""
    pg_sum: float
    """Sum of ``pg_r``."""
    kl_sum: float
    """Sum of ``kl_r`` (nats)."""
    clipped: int
    """Tokens whose ratio was clipped (outside [1 - eps, 1 + eps] on the side that matters)."""
    num_tokens: int
    """Masked-in tokens."""
    logprobs: torch.Tensor
    """[R] float32 detached ``logp_r`` (for the alignment check against the inference logprobs)."""


def policy_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    *,
    temperature: float,
    clip_eps: float = 0.2,
    kl_coef: float = 0.05,
) -> LossTerms:
    """The loss above over R completion rows.

    Args:
        logits: [R, V] float32 logits at the positions that predict each completion token.
        tokens: [R] int sampled tokens.
        inference_logprobs: [R] float32 logprobs recorded at sampling.
        advantages: [R] float32 advantage of each token's sample.
        loss_mask: [R] bool; rows outside it (padding, prompt-only) contribute exactly 0,
            whatever values they hold (NaN/-inf included).
        topk_ids: [R, k] int32/int64 inference head ids (masked rows: any id in [-1, V)).
        topk_logprobs: [R, k] float32 inference head logprobs.
        temperature: the sampler's temperature.
    """
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.long()[:, None])[:, 0]
    # Masked rows get harmless stand-ins, so garbage there cannot reach the gradient as NaN * 0.
    inference_logprobs = torch.where(loss_mask, inference_logprobs, logp.detach())
    topk_logprobs = torch.where(loss_mask[:, None], topk_logprobs, torch.zeros((), dtype=topk_logprobs.dtype))
    ratio = torch.exp(logp - inference_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    pg = -torch.minimum(unclipped, clipped)
    head = logp_all.gather(-1, topk_ids.long().clamp(min=0))
    q_log = torch.log_softmax(topk_logprobs, dim=-1)
    kl = (q_log.exp() * (q_log - torch.log_softmax(head, dim=-1))).sum(-1)
    zero = torch.zeros((), dtype=logits.dtype)
    pg = torch.where(loss_mask, pg, zero)
    kl = torch.where(loss_mask, kl, zero)
    return LossTerms(
        loss_sum=(pg + kl_coef * kl).sum(),
        pg_sum=float(pg.detach().sum()),
        kl_sum=float(kl.detach().sum()),
        clipped=int((loss_mask & (clipped < unclipped)).sum()),
        num_tokens=int(loss_mask.sum()),
        logprobs=logp.detach(),
    )
