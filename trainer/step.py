"""One trainer rank's per-step data path: load, fetch + assemble, agree, stand in, train, release, metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from pydantic import BaseModel, ConfigDict
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_file import StepFile, StepHeader
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ConfigError, DoubleDeleteError, FetchError, UnknownRefError
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store
from refpipe.trainer.assemble import AssembledMicroBatch, assemble_dropped_micro_batch
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.dist import Topology, agree_failures, gather_rank_values
from refpipe.trainer.fetch import FetchedStep, fetch_own, wait_for_step
from refpipe.trainer.tensors import TrainMicroBatch, to_torch

log = logging.getLogger(__name__)

Train = Callable[[list[TrainMicroBatch]], None]
"""The caller's training of one step: gets this rank's micro batches in order (dropped ones included,
flagged ``dropped``, so model-parallel collectives keep their shape); the main job supplies the model."""


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
    """Wall seconds of a rank's fetch (with the assembly pipelined into it), mean over ranks."""
    fetch_seconds_max: float
    """Wall seconds of a rank's fetch (with the assembly pipelined into it), max over ranks."""
    failed_fetches: int
    """Fetches that ended in an error after retries (and micro batches whose rows disagreed with the step
    file), summed over ranks."""
    retries: int
    """Store retries of transient errors during fetch and release, summed over ranks."""
    deletes: int
    """Chunks deleted after the step (once each, by the ``mp_rank == 0`` rank of their owner DP rank)."""
    delete_problems: int
    """Double deletes and deletes of never-kept chunks the ledger reported (recorded there too)."""


class TrainerRank:
    """The data path of one trainer rank.

    Which ranks call what, in which order:

    1. every rank: ``trainer.dist.init_process_group`` (or its own gloo/NCCL world with a
       timeout), then ``TrainerRank(...)``; the ``mp_rank == 0`` rank of each DP rank opens
       the ledger ``trainer_dp<dp_rank>``.
    2. every rank, for every step in the same order: ``run_step(step, train)``, which runs

       a. load step: wait for and validate the step file (every rank reads it);
       b. fetch own: this DP rank's micro batches' chunks, in parallel, each micro batch
          assembled into its padded numpy layout as soon as its chunks are in
          (``trainer.fetch``); errors become failure flags;
       c. agree failures: world all-reduce of the flags (collective);
          if no micro batch was fetched anywhere, every rank raises ``FetchError`` here;
       d. stand in for dropped micro batches (shape-only, no loss), then tensors;
       e. train: the caller's callback (its collectives are its own);
       f. release: the ``mp_rank == 0`` rank deletes the chunks its DP rank owns through the
          ledger and records ``release`` (after (c), so every rank has finished fetching);
       g. metrics: world all-gather of per-rank counters (collective).
    3. every rank: ``close()`` at a clean shutdown.

    Args:
        store: the run's store, created in this process.
        fields: the run's field shapes.
        storage: fetch concurrency (``max_concurrent_fetches``) and retries.
        config: topology and timeouts.
    """

    def __init__(self, store: Store, fields: FieldsConfig, storage: StorageConfig, config: TrainerConfig):
        self.store, self.fields, self.storage, self.config = store, fields, storage, config
        self.topology = Topology.current(config)
        dp_rank = self.topology.dp_rank
        self.ledger = Ledger(store, f"trainer_dp{dp_rank}") if self.topology.mp_rank == 0 else None

    def run_step(self, step: int, train: Train) -> StepMetrics:
        """Run steps (a)-(g) of the class docstring for ``step``.

        Raises:
            StepFileError: the step file did not appear within ``step_timeout_s`` or is invalid.
            ConfigError: the step file's ``dp_world_size`` differs from this world's.
            FetchError: no micro batch of the step could be fetched on any rank (nothing deleted).
            torch.distributed.DistBackendError: a peer died or exceeded ``collective_timeout_s``.
        """
        retries_before = self.store.retries
        step_file = self.load_step(step)
        header, dp_rank = step_file.header, self.topology.dp_rank
        fetched = fetch_own(self.store, step_file, dp_rank, self.fields,
                            max_concurrency=self.storage.max_concurrent_fetches)
        dropped = self.agree_failures(header, fetched)
        batches = self.stand_in_dropped(step_file, fetched, dropped[dp_rank])
        train([to_torch(mb) for mb in batches])
        deletes, problems = self.release(header)
        return self.metrics(header, fetched, dropped, deletes, problems, self.store.retries - retries_before)

    def load_step(self, step: int) -> StepFile:
        """(a) Wait for step ``step``'s file and check it was made for this world's DP size and fields."""
        step_file = wait_for_step(self.store, step, timeout_s=self.config.step_timeout_s,
                                  poll_s=self.config.step_poll_s)
        if step_file.header.dp_world_size != self.topology.dp_world_size:
            raise ConfigError(f"step file {step_file.uri}: dp_world_size={step_file.header.dp_world_size}, but this "
                              f"world has {self.topology.dp_world_size} DP ranks (world_size="
                              f"{self.topology.world_size}, model_parallel_size={self.config.model_parallel_size})")
        if step_file.header.fields != self.fields:
            raise ConfigError(f"step file {step_file.uri}: fields {step_file.header.fields.model_dump()}, but this "
                              f"trainer was configured with {self.fields.model_dump()}")
        return step_file

    def agree_failures(self, header: StepHeader, fetched: FetchedStep) -> np.ndarray:
        """(c) bool [dp_world_size, micro batches per DP rank]: dropped micro batches, the same on every rank.

        Raises:
            FetchError: every micro batch of the step is dropped (raised on every rank alike).
        """
        per_dp_rank = len(header.micro_batches_of(0))
        dropped = agree_failures(fetched.failed, self.topology, per_dp_rank)
        if dropped.size and dropped.all():
            raise FetchError(f"step {header.step}: none of its {dropped.size} micro batches could be fetched on any "
                             f"rank; dp_rank={self.topology.dp_rank} rank={self.topology.rank} errors: "
                             f"{fetched.errors[:3]}")
        return dropped

    def stand_in_dropped(self, step_file: StepFile, fetched: FetchedStep,
                         dropped: np.ndarray) -> list[AssembledMicroBatch]:
        """(d) This DP rank's micro batches in order, each dropped one replaced by its shape-only stand-in.

        A stand-in repeats the routing rows of the first micro batch that was not dropped, so every
        model-parallel peer builds the same one (peers agree on ``dropped``, not on what they fetched).
        """
        header, dp_rank = step_file.header, self.topology.dp_rank
        mbs = header.micro_batches_of(dp_rank)
        kept = [fetched.assembled[mb.index] for mb in mbs if not dropped[mb.index]]
        routing_rows = next((a.fields["routed_experts"].values for a in kept if "routed_experts" in a.fields), None)
        return [assemble_dropped_micro_batch(mb, step_file.streams(dp_rank, mb.index), seq_len=header.seq_len,
                                             fields=self.fields, routing_rows=routing_rows)
                if dropped[mb.index] else fetched.assembled[mb.index] for mb in mbs]

    def release(self, header: StepHeader) -> tuple[int, int]:
        """(f) ``mp_rank == 0`` only: delete this DP rank's owned chunks, record ``release``, flush.

        Returns:
            ``(deleted, problems)``: chunks deleted, and double/unknown deletes the ledger reported
            (logged and recorded; the remaining chunks are still deleted).
        """
        if self.ledger is None:
            return 0, 0
        dp_rank = self.topology.dp_rank
        try:
            result = self.ledger.delete(header.owned_refs(dp_rank), reason=f"trained step {header.step}",
                                        max_concurrency=self.storage.max_concurrent_fetches)
        except (DoubleDeleteError, UnknownRefError) as e:
            log.error("step %d dp_rank=%d release: %s", header.step, dp_rank, e)
            result = e.result
        self.ledger.record("release", step=header.step, dp_rank=dp_rank)
        self.ledger.flush()
        return len(result.deleted), len(result.double_deletes) + len(result.unknown)

    def metrics(self, header: StepHeader, fetched: FetchedStep, dropped: np.ndarray, deletes: int, problems: int,
                retries: int) -> StepMetrics:
        """(g) Gather every rank's counters (world all-gather) into the step's metrics."""
        local = np.array([fetched.seconds, fetched.chunks, fetched.nbytes, len(fetched.errors), retries, deletes,
                          problems], np.float64)
        seconds, chunks, nbytes, errors, retries_all, deletes_all, problems_all = gather_rank_values(local).T
        metrics = StepMetrics(
            step=header.step, micro_batches=len(header.micro_batches), dropped_micro_batches=int(dropped.sum()),
            fetched_chunks=int(chunks.sum()), fetched_bytes=int(nbytes.sum()),
            fetch_seconds_mean=float(seconds.mean()), fetch_seconds_max=float(seconds.max()),
            failed_fetches=int(errors.sum()), retries=int(retries_all.sum()), deletes=int(deletes_all.sum()),
            delete_problems=int(problems_all.sum()))
        log.info("step %d trainer metrics: %s", header.step, metrics.model_dump())
        return metrics

    def close(self) -> None:
        """Clean shutdown: close this rank's ledger (``mp_rank == 0`` ranks)."""
        if self.ledger is not None:
            self.ledger.close()
