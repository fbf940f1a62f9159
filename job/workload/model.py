"""A small mixture-of-experts causal LM over bytes, in plain torch (CPU, float32).

Every layer is pre-norm causal self-attention (learned absolute positions) followed
by an MoE MLP: ``num_experts`` SiLU experts, top-``top_k`` routing with a softmax gate
over the router logits of the chosen experts (i.e. softmax over all experts,
renormalised over the chosen ones). The forward works on packed varlen sequences
(``cu_seqlens``) for both sampling and training, and can *replay* routing: given
``routed_experts`` it uses exactly those expert ids, and because the gate weights are
computed the same way for chosen and replayed ids, a replayed forward performs the
same arithmetic as the forward that chose the routing.

Vocabulary: byte ``b`` is token ``b`` (0..255); ``BOS_ID``, ``EOS_ID``, ``PAD_ID`` follow.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field, model_validator
from torch import nn

from refpipe.storage.config import CONFIG
from refpipe.storage.errors import ConfigError, FieldError

BOS_ID = 256
"""Begins every prompt."""
EOS_ID = 257
"""Ends a completion; sampling a branch stops when it is drawn."""
PAD_ID = 258
"""Padding token; never a model input in refpipe's packed batches, never a target."""
VOCAB_SIZE = 259
"""256 bytes + BOS, EOS, PAD."""


class ModelConfig(BaseModel):
    """Shape and seed of the MoE policy (defaults: ~250k parameters)."""

    model_config = CONFIG

    d_model: int = Field(default=64, ge=8, le=4096)
    """Width of the residual stream (the main job's policy trains on CPU: at most 4,096)."""
    num_layers: int = Field(default=2, ge=1, le=128)
    """Transformer layers, each with one MoE MLP (= layers of ``routed_experts``)."""
    num_heads: int = Field(default=4, ge=1, le=128)
    """Attention heads; must divide ``d_model``."""
    num_experts: int = Field(default=8, ge=2, le=256)
    """Experts per MoE layer (<= 256 so expert ids fit uint8)."""
    top_k: int = Field(default=2, ge=1, le=256)
    """Experts routed per token per layer."""
    expert_hidden: int = Field(default=96, ge=1, le=16384)
    """Hidden width of each expert's SiLU MLP."""
    max_positions: int = Field(default=64, ge=2, le=65536)
    """Learned position embeddings; every ``position_ids`` value must be below this (at most 65,536)."""
    seed: int = 0
    """Seed of the parameter initialisation."""

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ConfigError(f"ModelConfig.num_heads={self.num_heads} must divide d_model={self.d_model}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"ModelConfig.top_k={self.top_k} must be <= num_experts={self.num_experts}")
        return self


class MoEMLP(nn.Module):
    """One layer's experts and router."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, h = cfg.num_experts, cfg.d_model, cfg.expert_hidden
        self.top_k = cfg.top_k
        self.router = nn.Linear(d, e, bias=False)
        self.w_in = nn.Parameter(torch.randn(e, d, h) * d**-0.5)
        self.w_out = nn.Parameter(torch.randn(e, h, d) * h**-0.5 / 2)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] float32; replay [T, top_k] int64 or None (ids < 0: route freely).

        Returns (y [T, d] float32, expert ids [T, top_k] int64).
        """
        router_logits = self.router(x)
        ids = router_logits.topk(self.top_k, dim=-1).indices
        if replay is not None:
            ids = torch.where(replay < 0, ids, replay)
        gate = torch.softmax(router_logits.gather(-1, ids), dim=-1)
        y = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            hidden = F.silu(x[tok] @ self.w_in[e])
            y.index_add_(0, tok, (hidden @ self.w_out[e]) * gate[tok, slot, None])
        return y, ids


class Block(nn.Module):
    """Pre-norm causal self-attention + MoE MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.norm_attn, self.norm_mlp = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.moe = MoEMLP(cfg)

    def forward(self, x, layout, replay):
        x = x + self.proj(self._attend(self.qkv(self.norm_attn(x)), layout))
        y, ids = self.moe(self.norm_mlp(x), replay)
        return x + y, ids

    def _attend(self, qkv: torch.Tensor, layout: list[Bucket]) -> torch.Tensor:
        """Attention within each sequence: per bucket, scatter packed rows into padded form and back."""
        out = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)
        for b in layout:
            padded = qkv.new_zeros(b.num_rows, b.length, qkv.shape[-1])
            padded[b.row, b.offset] = qkv[b.tokens]
            q, k, v = padded.view(b.num_rows, b.length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out[b.tokens] = attended.transpose(1, 2).reshape(b.num_rows, b.length, -1)[b.row, b.offset]
        return out


class Bucket(NamedTuple):
    """Sequences of similar length, attended together as one padded batch [num_rows, length]."""

    tokens: torch.Tensor
    """[T_b] int64 packed indices of the bucket's tokens."""
    row: torch.Tensor
    """[T_b] int64 padded row of each token."""
    offset: torch.Tensor
    """[T_b] int64 position of each token in its sequence."""
    num_rows: int
    length: int


def packed_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> list[Bucket]:
    """Group the packed sequences into buckets of lengths in (2^(b-1), 2^b], so a long sequence
    (e.g. a padding sequence) pads only its own bucket's attention.

    Padding sits at the end of each padded row, so a causal mask alone keeps every real
    query off padding and off other sequences.

    Raises:
        FieldError: ``cu_seqlens`` is not int32/int64 [N + 1], starting at 0, non-decreasing,
            ending at ``num_tokens``.
    """
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or cu[-1] != num_tokens or bool((cu.diff() < 0).any()):
        raise FieldError(f"cu_seqlens {cu.tolist()[:8]}...: expected [N + 1] non-decreasing from 0 to T={num_tokens}")
    lengths = cu.diff()
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    bucket_of_seq = torch.tensor([(n - 1).bit_length() if n else -1 for n in lengths.tolist()])
    buckets = []
    for b in sorted(set(bucket_of_seq.tolist()) - {-1}):
        members = (bucket_of_seq == b).nonzero()[:, 0]
        row_of_seq = torch.full_like(lengths, -1)
        row_of_seq[members] = torch.arange(members.numel())
        tokens = (row_of_seq[seq] >= 0).nonzero()[:, 0]
        buckets.append(Bucket(tokens, row_of_seq[seq[tokens]], tokens - cu[seq[tokens]], members.numel(),
                              int(lengths[members].max())))
    return buckets


class MoELM(nn.Module):
    """The policy. Build with ``MoELM(ModelConfig(...))``; parameters are seeded by ``cfg.seed``."""

    def __init__(self, cfg: ModelConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            super().__init__()
            self.cfg = cfg
            self.embed = nn.Embedding(VOCAB_SIZE, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_positions, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, VOCAB_SIZE, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        routed_experts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward over packed sequences; attention never crosses a ``cu_seqlens`` boundary.

        Args:
            input_ids: [T] int32/int64 token ids < ``VOCAB_SIZE``.
            position_ids: [T] int32/int64 position of each token in its sequence (< max_positions).
            cu_seqlens: [N + 1] int32 sequence boundaries, ``cu_seqlens[-1] == T``.
            routed_experts: optional [T, num_layers, top_k] integer (uint8 from a chunk, or int64)
                expert ids to replay. Token-layer rows whose ids are negative (int64 only) are
                routed by the router, as are all rows when this is None.

        Returns:
            ``(logits [T, VOCAB_SIZE] float32, routing [T, num_layers, top_k] uint8)``: the
            routing actually used (equal to ``routed_experts`` on replayed rows).

        Raises:
            FieldError: a shape, id or boundary is out of range.
        """
        replay = self._check(input_ids, position_ids, cu_seqlens, routed_experts)
        layout = packed_layout(cu_seqlens, input_ids.numel())
        x = self.embed(input_ids.long()) + self.pos(position_ids.long())
        used = []
        for i, block in enumerate(self.blocks):
            x, ids = block(x, layout, None if replay is None else replay[:, i])
            used.append(ids)
        logits = self.head(self.norm(x))
        return logits, torch.stack(used, dim=1).to(torch.uint8)

    def _check(self, input_ids, position_ids, cu_seqlens, routed_experts) -> torch.Tensor | None:
        t, cfg = input_ids.numel(), self.cfg
        if input_ids.shape != (t,) or position_ids.shape != (t,):
            raise FieldError(f"input_ids {list(input_ids.shape)} / position_ids {list(position_ids.shape)}: "
                             "expected [T]")
        if t and (int(input_ids.min()) < 0 or int(input_ids.max()) >= VOCAB_SIZE):
            raise FieldError(f"input_ids outside [0, {VOCAB_SIZE}): "
                             f"got {int(input_ids.min())}..{int(input_ids.max())}")
        if t and int(position_ids.max()) >= cfg.max_positions:
            raise FieldError(f"position_ids max {int(position_ids.max())}: "
                             f"expected < max_positions={cfg.max_positions}")
        if routed_experts is None:
            return None
        if routed_experts.shape != (t, cfg.num_layers, cfg.top_k):
            raise FieldError(f"routed_experts shape {list(routed_experts.shape)}: "
                             f"expected [{t}, {cfg.num_layers}, {cfg.top_k}]")
        replay = routed_experts.to(torch.int64)
        if t and int(replay.max()) >= cfg.num_experts:
            raise FieldError(f"routed_experts id {int(replay.max())}: expected < num_experts={cfg.num_experts}")
        return replay


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[R] float32 ``log_softmax(logits / temperature)[r, tokens[r]]``: temperature-scaled, un-truncated.

    This is exactly the inference logprob the sampler records (top-p truncation is not
    applied), so the trainer recomputes it from its own logits [R, V] with this function.
    """
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.long()[:, None])[:, 0]
