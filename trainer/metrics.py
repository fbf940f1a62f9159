"""A trainer step's metrics, identical on every rank: one all-gather over the data group of a fixed-size byte row
per rank (its counters and its micro batches' replay hashes), unpacked into ``StepMetrics``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict, cast

import numpy as np
from pydantic import BaseModel, ConfigDict


class StepMetrics(BaseModel):
    """One step's trainer metrics, identical on every rank (gathered over the world)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    micro_batches: int
    """Micro batches of the step, all DP ranks."""
    dropped_micro_batches: int
    """Micro batches dropped from the loss because some rank could not fetch them, summed over DP ranks."""
    fetched_chunks: int
    """Chunks fetched, summed over every rank (model-parallel peers each fetch their DP rank's chunks)."""
    fetched_bytes: int
    """Bytes of kept rows fetched, summed over every rank."""
    fetch_seconds_mean: float
    """Wall seconds of a rank's fetch (with the assembly pipelined into it), mean over ranks; a prefetched
    step's fetch ran while the previous step trained."""
    fetch_seconds_max: float
    """Wall seconds of a rank's fetch (with the assembly pipelined into it), max over ranks."""
    exposed_data_seconds_mean: float
    """Wall seconds of ``run_step`` outside ``train`` (of ``open_step`` and ``TrainingStep.release``) and before
    the metrics all-gather, less ``step_wait_seconds`` (waiting for the fetch, the failure all-reduce, stand-ins,
    tensors, waiting for the previous release), mean over ranks: the data path's time on the critical path."""
    exposed_data_seconds_max: float
    """As ``exposed_data_seconds_mean``, max over ranks."""
    step_wait_seconds_max: float
    """Seconds a rank's ``open_step`` waited for the step file to appear (the orchestrator was behind; not a
    data-path cost), max over ranks."""
    prefetched_ranks: int
    """Ranks whose data of this step was fetched in the background while the previous step trained."""
    failed_fetches: int
    """Fetches that ended in an error after retries (and micro batches whose rows disagreed with the step
    file), summed over ranks."""
    retries: int
    """Store retries of transient errors since the previous step's metrics (fetch, prefetch, release), summed
    over ranks."""
    deletes: int
    """Chunks deleted by background releases collected since the previous step's metrics (with ``after_step``,
    step N's metrics count step N-2's release: a step's release runs while the next one trains and may queue
    behind the one before it; ``TrainerRank.finish`` counts the last two), by the ``mp_rank == 0`` rank of
    their owner DP rank."""
    delete_problems: int
    """Double deletes and deletes of never-kept chunks the ledger reported (recorded there too), same window."""
    delete_failures: int
    """Chunks whose physical delete failed in the same window (recorded as ``delete_failed``; retried)."""
    skipped: bool = False
    """Not trained: a step after the checkpoint a restarted trainer resumed from, whose chunks were already
    (partly) deleted (``TrainerRank.skip_step``)."""
    micro_batch_hashes: list[list[str]]
    """[dp_world_size][micro batches per DP rank] ``trainer.replay_hash.micro_batch_hash`` of each micro batch as
    trained ("" for a dropped one): a replay of the step after a crash must reproduce them."""


class ReleaseMetrics(BaseModel):
    """Counts of ``StepMetrics`` for the releases that finished after the last step's metrics (``finish``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    retries: int
    deletes: int
    delete_problems: int
    delete_failures: int


class ReleaseSums(TypedDict):
    """``release_metrics``' world sums, by ``ReleaseMetrics`` field name."""

    retries: int
    deletes: int
    delete_problems: int
    delete_failures: int


def release_metrics(columns: Iterable[np.ndarray]) -> ReleaseSums:
    """[retries, deletes, problems, failures] per rank (columns) -> their world sums by field name."""
    names = ("retries", "deletes", "delete_problems", "delete_failures")
    return cast(ReleaseSums, dict(zip(names, (int(c.sum()) for c in columns))))


DIGEST_NBYTES = 16
"""Bytes of one replay hash (``trainer.replay_hash.micro_batch_hash``: XXH3-128, 32 hex digits)."""


def pack_row(counters: np.ndarray, hashes: list[str]) -> np.ndarray:
    """uint8 [8 * len(counters) + 16 * len(hashes)]: float64 ``counters`` as bytes, then each hash's 16 bytes
    (zeros for "", a dropped micro batch); the same length on every rank (DP ranks have equally many micro
    batches, ``StepHeader`` checks)."""
    digests = np.zeros((len(hashes), DIGEST_NBYTES), np.uint8)
    for i, h in enumerate(hashes):
        if h:
            digests[i] = np.frombuffer(bytes.fromhex(h), np.uint8)
    return np.concatenate([np.ascontiguousarray(counters, np.float64).view(np.uint8), digests.reshape(-1)])


def unpack_rows(rows: np.ndarray, num_counters: int, num_hashes: int) -> tuple[np.ndarray, np.ndarray]:
    """``pack_row``'s rows of every rank -> (float64 [world_size, num_counters], uint8 [world_size, num_hashes,
    16])."""
    split = 8 * num_counters
    counters = np.ascontiguousarray(rows[:, :split]).view(np.float64)
    return counters, rows[:, split:].reshape(len(rows), num_hashes, DIGEST_NBYTES)
