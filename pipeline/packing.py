"""Pack a step's samples into micro batches per DP rank: the orchestrator's packing policies.

A packer is a function ``packer(samples, *, seq_len, dp_world_size) -> per_rank`` (``Packer``):
``per_rank[r]`` is DP rank ``r``'s micro batches, each a non-empty list of samples of at most
``seq_len`` tokens that either all carry ``routed_experts`` or none does (samples with other side
channels and samples without any arrays may share one). Every sample is placed exactly once.
Ranks may end with different numbers of micro batches; ``pad_ranks`` evens them out.

- ``balanced_packer`` (the default): samples to DP ranks by token count, largest first, each to the
  rank with the fewest tokens so far (ties: lowest rank), so DP ranks get comparable work; then
  first-fit-decreasing within each rank and kind.
- ``first_fit_packer``: first-fit-decreasing by tokens within each kind over the whole step, then
  micro batches to DP ranks greedily by token load, largest first, each rank taking at most
  ``ceil(M / dp_world_size)``: the fewest micro batches, but a small step may leave a rank only padding.

``pad_ranks`` fills each short rank with zero-loss padding dummies: a copy of the step's shortest
sample (preferring the rank's own) with ``loss_mask`` all False and zero advantages, ``env_name``
``PADDING_ENV_NAME``. When the step carries routing, the dummy copies a routing sample and
*borrows* its chunk (the step file marks it ``borrowed``); the chunk's owner is the DP rank of the
real sample, so it is deleted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.publish import PackedSequence, StepMicroBatch
from refpipe.pipeline.publish import step_contents as publish_contents
from refpipe.pipeline.samples import Sample
from refpipe.pipeline.step_header import STREAMS, StepHeader
from refpipe.storage.errors import PackingError

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


def first_fit_packer(samples: Sequence[Sample], *, seq_len: int, dp_world_size: int) -> list[list[list[Sample]]]:
    """First-fit-decreasing over the step, then micro batches to DP ranks by load (see module doc)."""
    batches = [b for routing in (True, False) for b in _first_fit([s for s in samples if s.has_routing == routing],
                                                                  seq_len)]
    per_rank = assign_to_ranks(np.array([sum(s.num_tokens for s in b) for b in batches]), dp_world_size)
    return [[batches[m] for m in indices] for indices in per_rank]


def balanced_packer(samples: Sequence[Sample], *, seq_len: int, dp_world_size: int) -> list[list[list[Sample]]]:
    """Samples to DP ranks balancing tokens, then first-fit-decreasing within each rank (see module doc).

    Returns:
        ``per_rank[r]``: DP rank ``r``'s micro batches; a rank gets no micro batch only when the step has
        fewer samples than DP ranks.
    """
    lengths = np.array([s.num_tokens for s in samples], np.int64)
    load = np.zeros(dp_world_size, np.int64)
    ranks: list[list[Sample]] = [[] for _ in range(dp_world_size)]
    for i in np.argsort(-lengths, kind="stable"):
        r = int(np.argmin(load))
        ranks[r].append(samples[i])
        load[r] += lengths[i]
    return [[b for routing in (True, False) for b in _first_fit([s for s in own if s.has_routing == routing], seq_len)]
            for own in ranks]


def _first_fit(samples: Sequence[Sample], seq_len: int) -> list[list[Sample]]:
    lengths = np.array([s.num_tokens for s in samples], np.int64)
    return [[samples[i] for i in b] for b in first_fit_decreasing(lengths, seq_len)]


Packer = Callable[..., list[list[list[Sample]]]]
"""``packer(samples, *, seq_len, dp_world_size) -> per_rank`` (module doc); ``balanced_packer`` is the default."""


def pack_step(samples: Sequence[Sample], *, seq_len: int, dp_world_size: int,
              packer: Packer = balanced_packer) -> list[PackedMicroBatch]:
    """Pack one step's samples with ``packer`` into an equal number of micro batches per DP rank (``pad_ranks``).

    Args:
        samples: at least one; each ``num_tokens <= seq_len``.
        seq_len: token budget of a micro batch.
        dp_world_size: data-parallel ranks.
        packer: the packing policy (module doc).

    Returns:
        Micro batches ordered by ``(dp_rank, index)``.

    Raises:
        PackingError: no samples, a sample longer than ``seq_len``, or ``packer`` broke its contract (a sample
            placed twice or not at all, an empty or overfull micro batch, routing mixed, not one list per rank).
    """
    if not samples:
        raise PackingError("pack_step: no samples to pack: expected at least one")
    too_long = [s.episode_id for s in samples if s.num_tokens > seq_len]
    if too_long:
        raise PackingError(f"samples of episodes {too_long[:5]} are longer than seq_len={seq_len}")
    per_rank = packer(samples, seq_len=seq_len, dp_world_size=dp_world_size)
    _check_packer(packer, per_rank, samples, seq_len, dp_world_size)
    return pad_ranks(per_rank, samples)


def _check_packer(packer: Packer, per_rank: list[list[list[Sample]]], samples: Sequence[Sample], seq_len: int,
                  dp_world_size: int) -> None:
    placed = sorted(id(s) for batches in per_rank for b in batches for s in b)
    problem = None
    if len(per_rank) != dp_world_size:
        problem = f"{len(per_rank)} lists of micro batches: expected one per DP rank ({dp_world_size})"
    elif placed != sorted(id(s) for s in samples):
        problem = f"{len(placed)} samples placed: expected each of the {len(samples)} samples exactly once"
    for r, batches in enumerate(per_rank):
        for i, b in enumerate(batches):
            if problem is None and not (b and sum(s.num_tokens for s in b) <= seq_len
                                        and len({s.has_routing for s in b}) == 1):
                problem = (f"dp_rank={r} micro batch {i}: expected 1..{seq_len} tokens of samples that all carry "
                           f"routed_experts or none does")
    if problem:
        raise PackingError(f"packer {getattr(packer, '__name__', packer)!r}: {problem}")


def pad_ranks(per_rank: Sequence[Sequence[Sequence[Sample]]], samples: Sequence[Sample]) -> list[PackedMicroBatch]:
    """The micro batches of ``per_rank`` with each short rank filled by padding dummies (module doc), ordered
    by ``(dp_rank, index)``; ``samples`` are the step's samples (a rank without its own lends from them)."""
    width = max(len(r) for r in per_rank)
    out: list[PackedMicroBatch] = []
    for rank, batches in enumerate(per_rank):
        out += [PackedMicroBatch(rank, i, tuple(b), b[0].has_routing, is_dummy=False) for i, b in enumerate(batches)]
        own = [s for b in batches for s in b]
        out += [_dummy_batch(rank, i, own, samples) for i in range(len(batches), width)]
    return out


def _dummy_batch(rank: int, index: int, own: Sequence[Sample], samples: Sequence[Sample]) -> PackedMicroBatch:
    """The padding micro batch ``index`` of ``rank``: borrow routing if the step carries any."""
    routing = any(s.has_routing for s in samples)
    pool = [s for s in own if s.has_routing or not routing] or [s for s in samples if s.has_routing or not routing]
    source = min(pool, key=lambda s: s.num_tokens)
    return PackedMicroBatch(rank, index, (make_dummy(source, borrow=routing),), routing, is_dummy=True)


def step_metrics(samples: Sequence[Sample], num_groups: int, packed: Sequence[PackedMicroBatch]) -> dict[str, float]:
    """The orchestrator's step metrics (written into the step header) of ``samples`` from ``num_groups`` groups
    packed into ``packed``: counts, tokens (all and loss), micro batches, padding dummies, mean reward."""
    return {
        "num_groups": float(num_groups),
        "num_samples": float(len(samples)),
        "num_tokens": float(sum(s.num_tokens for s in samples)),
        "num_loss_tokens": float(sum(int(s.loss_mask.sum()) for s in samples)),
        "num_micro_batches": float(len(packed)),
        "num_dummies": float(sum(mb.is_dummy for mb in packed)),
        "reward_mean": float(np.mean([s.reward for s in samples])),
    }


def step_micro_batches(packed: Sequence[PackedMicroBatch], dp_world_size: int) -> list[list[StepMicroBatch]]:
    """``packed`` (ordered by ``(dp_rank, index)``) as ``publish_step``'s input: per DP rank, its micro batches
    with the samples' streams concatenated and one ``PackedSequence`` per sample (a dummy's: ``borrowed`` when it
    carries a payload)."""
    out: list[list[StepMicroBatch]] = [[] for _ in range(dp_world_size)]
    for mb in packed:
        sequences = [PackedSequence(s.num_tokens, s.env_name, s.payload, s.policy_version,
                                    borrowed=mb.is_dummy and s.payload is not None) for s in mb.samples]
        streams = {name: np.concatenate([getattr(s, name) for s in mb.samples]) for name in STREAMS}
        out[mb.dp_rank].append(StepMicroBatch(sequences, streams))
    return out


def step_contents(packed: Sequence[PackedMicroBatch], *, step: int, run_uri: str, seq_len: int,
                  dp_world_size: int, fields: FieldsConfig, metrics: Mapping[str, float]
                  ) -> tuple[StepHeader, dict[tuple[int, int], dict[str, np.ndarray]]]:
    """The step file of packed micro batches (``publish.step_contents`` of ``step_micro_batches(packed)``).

    Returns:
        ``(header, streams)`` with ``streams[(dp_rank, index)][name]`` the [T] concatenation of
        the micro batch's samples' stream ``name``.

    Raises:
        PackingError: two real samples carry the same ref, or a ref's arrays disagree with
            ``fields`` (an array ``fields`` does not configure, or another trailing shape).
    """
    return publish_contents(step_micro_batches(packed, dp_world_size), step=step, run_uri=run_uri, seq_len=seq_len,
                            fields=fields, extra_streams={}, metrics=metrics)
