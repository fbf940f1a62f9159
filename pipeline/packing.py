"""Pack a step's samples into micro batches per DP rank, and lay them out as a step file.

Algorithm (``pack_step``):

1. Split the samples by whether they carry ``routed_experts``; the two kinds never share
   a micro batch (samples with other side channels and samples without any arrays do).
2. First-fit-decreasing by tokens within each kind, into micro batches of <= ``seq_len``.
3. Assign micro batches to DP ranks greedily by token load, largest first, each rank
   taking at most ``ceil(M / dp_world_size)``: every rank ends with that many or one
   fewer, and the short ranks are filled with zero-loss padding dummies (fewer than
   ``dp_world_size`` in all).
4. A dummy is a copy of the step's shortest sample (preferring the rank's own) with
   ``loss_mask`` all False and zero advantages, ``env_name`` ``PADDING_ENV_NAME``. When the
   step carries routing, the dummy copies a routing sample and *borrows* its chunk (the
   step file marks it ``borrowed``); the chunk's owner is the DP rank of the real sample,
   so it is deleted once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.samples import Sample
from refpipe.pipeline.step_file import SCHEMA_VERSION, STREAMS, MicroBatchRecord, SequenceRecord, StepHeader
from refpipe.storage.chunk import PayloadRef
from refpipe.storage.errors import PackingError, validation_problems

PADDING_ENV_NAME = "padding"
"""``env_name`` of padding dummies in step files."""


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro batch of one DP rank: real samples, or exactly one padding dummy."""

    dp_rank: int
    index: int
    """Position among the DP rank's micro batches."""
    samples: tuple[Sample, ...]
    has_routing: bool
    """Every sample carries ``routed_experts`` (a borrowing dummy counts)."""
    is_dummy: bool

    @property
    def num_tokens(self) -> int:
        """Real tokens: the sum of the samples' tokens (<= seq_len)."""
        return sum(s.num_tokens for s in self.samples)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bin indices of ``lengths`` [N] (tokens, each <= ``capacity``) with first-fit-decreasing.

    Returns:
        Bins in creation order, each a list of indices in placement (decreasing length) order,
        with ``sum(lengths[bin]) <= capacity``.
    """
    free = np.empty(len(lengths), np.int64)
    bins: list[list[int]] = []
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        fits = free[: len(bins)] >= lengths[i]
        b = int(np.argmax(fits)) if fits.any() else len(bins)
        if b == len(bins):
            bins.append([])
            free[b] = capacity
        bins[b].append(int(i))
        free[b] -= lengths[i]
    return bins


def assign_to_ranks(tokens: np.ndarray, dp_world_size: int) -> list[list[int]]:
    """Assign micro batches of ``tokens`` [M] to DP ranks: largest first, to the least-loaded
    rank that still has fewer than ``ceil(M / dp_world_size)`` (ties: lowest rank).

    Returns:
        ``dp_world_size`` lists of micro-batch indices, in assignment order.
    """
    cap = math.ceil(len(tokens) / dp_world_size)
    load = np.zeros(dp_world_size, np.int64)
    count = np.zeros(dp_world_size, np.int64)
    ranks: list[list[int]] = [[] for _ in range(dp_world_size)]
    for m in np.argsort(-np.asarray(tokens), kind="stable"):
        r = int(np.argmin(np.where(count < cap, load, np.iinfo(np.int64).max)))
        ranks[r].append(int(m))
        load[r] += tokens[m]
        count[r] += 1
    return ranks


def make_dummy(source: Sample, *, borrow: bool) -> Sample:
    """A zero-loss padding sample with ``source``'s tokens; ``borrow`` reuses its payload slice."""
    n = source.num_tokens
    return Sample(
        input_ids=source.input_ids, loss_mask=np.zeros(n, np.bool_), advantages=np.zeros(n, np.float32),
        inference_logprobs=np.zeros(n, np.float32), position_ids=source.position_ids,
        temperatures=source.temperatures, env_name=PADDING_ENV_NAME,
        payload=source.payload if borrow else None, policy_version=source.policy_version, reward=0.0,
        episode_id=source.episode_id,
    )


def pack_step(samples: Sequence[Sample], *, seq_len: int, dp_world_size: int) -> list[PackedMicroBatch]:
    """Pack one step's samples into an equal number of micro batches per DP rank (see module doc).

    Args:
        samples: at least one; each ``num_tokens <= seq_len``.
        seq_len: token budget of a micro batch.
        dp_world_size: data-parallel ranks.

    Returns:
        Micro batches ordered by ``(dp_rank, index)``.

    Raises:
        PackingError: no samples, or a sample longer than ``seq_len``.
    """
    if not samples:
        raise PackingError("pack_step: no samples to pack: expected at least one")
    too_long = [s.episode_id for s in samples if s.num_tokens > seq_len]
    if too_long:
        raise PackingError(f"samples of episodes {too_long[:5]} are longer than seq_len={seq_len}")
    batches: list[tuple[tuple[Sample, ...], bool]] = []
    for routing in (True, False):
        kind = [s for s in samples if s.has_routing == routing]
        lengths = np.array([s.num_tokens for s in kind], np.int64)
        batches += [(tuple(kind[i] for i in b), routing) for b in first_fit_decreasing(lengths, seq_len)]
    per_rank = assign_to_ranks(np.array([sum(s.num_tokens for s in b) for b, _ in batches]), dp_world_size)
    width = max(len(r) for r in per_rank)
    out: list[PackedMicroBatch] = []
    for rank, indices in enumerate(per_rank):
        out += [PackedMicroBatch(rank, i, *batches[m], is_dummy=False) for i, m in enumerate(indices)]
        own = [s for m in indices for s in batches[m][0]]
        out += [_dummy_batch(rank, i, own, samples) for i in range(len(indices), width)]
    return out


def _dummy_batch(rank: int, index: int, own: Sequence[Sample], samples: Sequence[Sample]) -> PackedMicroBatch:
    """The padding micro batch ``index`` of ``rank``: borrow routing if the step carries any."""
    routing = any(s.has_routing for s in samples)
    pool = [s for s in own if s.has_routing or not routing] or [s for s in samples if s.has_routing or not routing]
    source = min(pool, key=lambda s: s.num_tokens)
    return PackedMicroBatch(rank, index, (make_dummy(source, borrow=routing),), routing, is_dummy=True)


def step_contents(packed: Sequence[PackedMicroBatch], *, step: int, run_uri: str, seq_len: int,
                  dp_world_size: int, fields: FieldsConfig, metrics: Mapping[str, float]
                  ) -> tuple[StepHeader, dict[tuple[int, int], dict[str, np.ndarray]]]:
    """The step file of packed micro batches: header (refs, owners, sequences, ``fields``) and token streams.

    Every real sample's ref appears once in ``header.refs``, owned by the sample's DP rank;
    dummies point at that entry with ``borrowed=True``. ``fields`` (the run's field shapes)
    is written into the header as is.

    Returns:
        ``(header, streams)`` with ``streams[(dp_rank, index)][name]`` the [T] concatenation of
        the micro batch's samples' stream ``name``.

    Raises:
        PackingError: two real samples carry the same ref, or a ref's arrays disagree with
            ``fields`` (an array ``fields`` does not configure, or another trailing shape).
    """
    refs: list[PayloadRef] = []
    owners: list[int] = []
    index_of: dict[str, int] = {}
    for mb in (m for m in packed if not m.is_dummy):
        for s in (s for s in mb.samples if s.payload is not None):
            if s.payload.ref.branch_id in index_of:
                raise PackingError(f"step {step}: chunk {s.payload.ref.uri} is used by two samples "
                                   f"(episode {s.episode_id}): expected one sample per branch")
            index_of[s.payload.ref.branch_id] = len(refs)
            refs.append(s.payload.ref)
            owners.append(mb.dp_rank)
    records = [_record(mb, index_of, seq_len) for mb in packed]
    try:
        header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=run_uri, step=step, seq_len=seq_len,
                            dp_world_size=dp_world_size, micro_batches=records, refs=refs, owners=owners,
                            fields=fields, metrics=dict(metrics))
    except ValidationError as e:
        raise PackingError(f"step {step}: {validation_problems(e)}") from e
    streams = {(mb.dp_rank, mb.index): {name: np.concatenate([getattr(s, name) for s in mb.samples])
                                        for name in STREAMS} for mb in packed}
    return header, streams


def _record(mb: PackedMicroBatch, index_of: Mapping[str, int], seq_len: int) -> MicroBatchRecord:
    sequences = [SequenceRecord(num_tokens=s.num_tokens, env_name=s.env_name,
                                ref=None if s.payload is None else index_of[s.payload.ref.branch_id],
                                borrowed=mb.is_dummy and s.payload is not None,
                                policy_version=s.policy_version) for s in mb.samples]
    return MicroBatchRecord(dp_rank=mb.dp_rank, index=mb.index, sequences=sequences,
                            num_padding_tokens=seq_len - mb.num_tokens, has_routing=mb.has_routing)
