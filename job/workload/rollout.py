"""Sampling branches from the MoE policy, with the side channels refpipe carries.

The loop has no KV cache: each step runs the full packed forward (``MoELM.forward``)
over every unfinished sequence so far, so sampling computes logits exactly the way a
trainer forward over prompt + completion does. Routing is decided once per token,
when the token is first an input; later steps replay it (as a KV cache would hold
it), so the recorded routing is the routing behind every recorded logprob.

Sampler: ``p = softmax(logits / temperature)``; the support is the top-p nucleus (the
most probable ids until their mass reaches ``top_p``), capped at the ``support_width``
most probable ids; the token is drawn from ``p`` renormalised over the support.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, Field

from refpipe.job.workload.model import EOS_ID, MoELM
from refpipe.storage.config import CONFIG
from refpipe.storage.errors import ConfigError


class SamplingConfig(BaseModel):
    """How env servers sample completions."""

    model_config = CONFIG

    temperature: float = Field(default=1.0, gt=0)
    """Logits are divided by this before the softmax; recorded logprobs use the same scaling."""
    top_p: float = Field(default=0.95, gt=0, le=1)
    """Nucleus mass: the support is the most probable ids until their mass reaches ``top_p``."""
    max_completion_tokens: int = Field(default=24, ge=1, le=65536)
    """A completion stops at EOS or at this many tokens (EOS included in the count)."""
    logprobs_k: int = Field(default=8, ge=1, le=4096)
    """Width k of the top-k logprob head (``topk_ids`` / ``topk_logprobs`` [C, k])."""
    support_width: int = Field(default=16, ge=1, le=4096)
    """Width of ``sample_support`` [C, width]; also caps the sampler's support at this many ids."""


@dataclass(frozen=True)
class SampledBranch:
    """One sampled branch. Completion row ``r`` belongs to the position whose logits predict
    completion token ``r``: position ``P + r - 1`` of the prompt + completion sequence."""

    prompt_ids: np.ndarray
    """[P] int32 prompt tokens (``BOS_ID`` first)."""
    completion_ids: np.ndarray
    """[C] int32 sampled tokens; ends with ``EOS_ID`` unless cut at ``max_completion_tokens``."""
    logprobs: np.ndarray
    """[C] float32 ``log_softmax(logits / temperature)`` at each sampled token, before top-p
    truncation (``job.workload.model.token_logprobs``)."""
    routed_experts: np.ndarray
    """[P + C, num_layers, top_k] uint8 experts each token was routed to as an input."""
    topk_ids: np.ndarray
    """[C, logprobs_k] int32 most probable ids, most probable first."""
    topk_logprobs: np.ndarray
    """[C, logprobs_k] float32 their ``log_softmax(logits / temperature)``."""
    sample_support: np.ndarray
    """[C, support_width] int32 the sampler's support, most probable first, -1 = no id."""

    def fields(self) -> dict[str, np.ndarray]:
        """The side-channel fields, keyed by field name (``pipeline.fields.FIELDS``)."""
        return {"routed_experts": self.routed_experts, "topk_ids": self.topk_ids,
                "topk_logprobs": self.topk_logprobs, "sample_support": self.sample_support}


@dataclass
class _Buffers:
    """Per-batch state, padded to [N, P_max + C_max] tokens and [N, C_max] completion rows."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    routing: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    support: torch.Tensor


@torch.no_grad()
def sample_branches(model: MoELM, prompts: Sequence[np.ndarray], cfg: SamplingConfig, *,
                    seed: int) -> list[SampledBranch]:
    """Sample one completion per prompt (a batch of N prompts; deterministic in ``seed``).

    Args:
        model: the policy; its current weights sample every token.
        prompts: N arrays of prompt token ids (int, ``BOS_ID`` first), each non-empty.
        cfg: sampling settings.
        seed: seeds the sampler's generator.

    Returns:
        N ``SampledBranch`` in prompt order.

    Raises:
        ConfigError: a prompt plus ``max_completion_tokens`` exceeds the model's ``max_positions``.
    """
    gen = torch.Generator().manual_seed(seed)
    buf = _init_buffers(model, prompts, cfg)
    prompt_lengths = buf.lengths.clone()
    active = torch.arange(len(prompts))
    for step in range(cfg.max_completion_tokens):
        if active.numel() == 0:
            break
        last_logits = _forward(model, buf, active)
        tokens = _sample(last_logits, buf, active, step, cfg, gen)
        buf.tokens[active, buf.lengths[active]] = tokens
        buf.lengths[active] += 1
        active = active[tokens != EOS_ID]
    _forward(model, buf, torch.arange(len(prompts)))  # routes each completion's last token
    return [_branch(buf, i, int(prompt_lengths[i])) for i in range(len(prompts))]


def _init_buffers(model: MoELM, prompts: Sequence[np.ndarray], cfg: SamplingConfig) -> _Buffers:
    n, c, mcfg = len(prompts), cfg.max_completion_tokens, model.cfg
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    width = int(lengths.max()) + c
    if width > mcfg.max_positions or int(lengths.min()) < 1:
        raise ConfigError(f"prompt lengths {int(lengths.min())}..{int(lengths.max())} + max_completion_tokens={c}: "
                          f"expected non-empty prompts and at most max_positions={mcfg.max_positions} tokens")
    tokens = torch.zeros(n, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.as_tensor(np.asarray(p), dtype=torch.int64)
    return _Buffers(
        tokens=tokens, lengths=lengths,
        routing=torch.full((n, width, mcfg.num_layers, mcfg.top_k), -1, dtype=torch.int64),
        logprobs=torch.zeros(n, c), topk_ids=torch.zeros(n, c, cfg.logprobs_k, dtype=torch.int64),
        topk_logprobs=torch.zeros(n, c, cfg.logprobs_k), support=torch.full((n, c, cfg.support_width), -1),
    )


def _forward(model: MoELM, buf: _Buffers, rows: torch.Tensor) -> torch.Tensor:
    """Packed forward over sequences ``rows``; records new routing; returns last logits [len(rows), V]."""
    lengths = buf.lengths[rows]
    valid = torch.arange(buf.tokens.shape[1]) < lengths[:, None]
    positions = torch.arange(buf.tokens.shape[1]).expand_as(valid)[valid]
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    routing = buf.routing[rows]
    logits, used = model(buf.tokens[rows][valid], positions, cu_seqlens, routing[valid])
    routing[valid] = used.to(torch.int64)
    buf.routing[rows] = routing
    return logits[cu_seqlens[1:].long() - 1]


def _sample(logits: torch.Tensor, buf: _Buffers, rows: torch.Tensor, step: int, cfg: SamplingConfig,
            gen: torch.Generator) -> torch.Tensor:
    """Draw one token per row from the capped top-p support; record completion row ``step``."""
    logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logp.exp()
    in_support = (probs.cumsum(-1) - probs) < cfg.top_p
    in_support[:, cfg.support_width:] = False
    pick = torch.multinomial(probs * in_support, 1, generator=gen)
    tokens = order.gather(-1, pick)[:, 0]
    width, k = cfg.support_width, cfg.logprobs_k
    buf.logprobs[rows, step] = logp.gather(-1, tokens[:, None])[:, 0]
    buf.topk_ids[rows, step] = order[:, :k]
    buf.topk_logprobs[rows, step] = sorted_logp[:, :k]
    buf.support[rows, step] = torch.where(in_support[:, :width], order[:, :width], -1)
    return tokens


def _branch(buf: _Buffers, i: int, num_prompt: int) -> SampledBranch:
    total = int(buf.lengths[i])
    c = total - num_prompt
    return SampledBranch(
        prompt_ids=buf.tokens[i, :num_prompt].numpy().astype(np.int32),
        completion_ids=buf.tokens[i, num_prompt:total].numpy().astype(np.int32),
        logprobs=buf.logprobs[i, :c].numpy().copy(),
        routed_experts=buf.routing[i, :total].numpy().astype(np.uint8),
        topk_ids=buf.topk_ids[i, :c].numpy().astype(np.int32),
        topk_logprobs=buf.topk_logprobs[i, :c].numpy().copy(),
        sample_support=buf.support[i, :c].numpy().astype(np.int32),
    )
