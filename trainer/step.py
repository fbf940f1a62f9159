"""One trainer rank's per-step data path: load, fetch + assemble, agree, stand in, prefetch, train, release,
metrics."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch.distributed as dist

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_file import StepFile
from refpipe.pipeline.step_header import StepHeader
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ConfigError, FetchError
from refpipe.storage.layout import trainer_actor
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store
from refpipe.trainer.assemble import AssembledMicroBatch, assemble_dropped_micro_batch, real_token_rows
from refpipe.trainer.background import BackgroundRelease, Prefetch, Prepared, ReleaseCounts
from refpipe.trainer.buffers import BufferPool
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.dist import Topology, agree_failures, gather_rank_rows, gather_rank_values, new_data_group
from refpipe.trainer.fetch import FetchedStep, fetch_own, wait_for_step
from refpipe.trainer.loop import PullLoop, TrainingStep
from refpipe.trainer.metrics import ReleaseMetrics, StepMetrics, pack_row, release_metrics, unpack_rows
from refpipe.trainer.pause import pause_point
from refpipe.trainer.release import ReleasePolicy
from refpipe.trainer.resume import ResumePlan, plan_resume
from refpipe.trainer.tensors import TrainMicroBatch, to_torch

log = logging.getLogger(__name__)

Train = Callable[[list[TrainMicroBatch]], None]
"""The caller's training of one step: gets this rank's micro batches in order (dropped ones included,
flagged ``dropped``, so model-parallel collectives keep their shape); the main job supplies the model."""


class TrainerRank:
    """The data path of one trainer rank.

    Which ranks call what, in which order:

    1. every rank: ``trainer.dist.init_process_group`` (or its own gloo/NCCL world with a
       timeout), then ``TrainerRank(...)`` (collective: it creates the gloo data group unless one
       is passed); the ``mp_rank == 0`` rank of each DP rank opens the ledger ``trainer_dp<dp_rank>``.
    2. every rank, for every step in the same order: ``run_step(step, train)``, which runs

       a. load step: take the prefetched step, or wait for and validate the step file
          (every rank reads it);
       b. fetch own (unless prefetched): this DP rank's micro batches' chunks, in parallel,
          each micro batch assembled into its padded numpy layout and hashed (its replay hash,
          ``trainer.replay_hash.micro_batch_hash``) as soon as its chunks are in, on the fetch
          threads (``trainer.fetch``), into arrays of the rank's ``trainer.buffers.BufferPool``
          (the memory of earlier steps' arrays nothing refers to any more: already faulted in;
          a tensor the train callback kept keeps its memory); errors become failure flags;
       c. agree failures: all-reduce of the flags over the data group (collective);
          if no micro batch was fetched anywhere, every rank raises ``FetchError`` here;
       d. stand in for dropped micro batches (shape-only, no loss), then tensors;
       e. prefetch: start fetching step + 1 (the next step a resume plan does not skip) in the
          background (``trainer.background.Prefetch``; at most one step ahead, so a rank holds at
          most two steps of arrays: this one and the next; its failures are agreed in step + 1's
          (c), like any fetch's); started after (d), whose Python would otherwise wait for the GIL
          behind the prefetch's fetch threads on the rank's main thread;
       f. train: the caller's callback (its collectives are its own);
       g. release: the ``mp_rank == 0`` rank hands the step to its ``trainer.release.ReleasePolicy``
          (``config.release``): now, or once a checkpoint covers it, it queues the deletes (or the
          retain) of the chunks its DP rank owns on the background release thread, recording
          ``release`` once done (after (c), so every rank has finished fetching); it waits only for
          releases older than the previous one (``trainer.background.BackgroundRelease``);
       h. metrics: one all-gather over the data group (collective) of a fixed-size byte row per rank:
          its counters, its release counts and its micro batches' replay hashes (16 bytes each).

    So every rank joins exactly two collectives of the data group per step, in this order: the failure
    all-reduce (c) and the metrics all-gather (h).

    A trainer that drives its own loop pulls the steps instead (``trainer.loop``): ``for step in
    rank.steps(stop): ...; step.release()`` runs (a)-(e) as the step is yielded and (g)+(h) at its
    ``release()``, called after the caller's optimizer step; ``run_step`` is ``open_step``, ``train``,
    ``release``.

    3. every rank, after a checkpoint covering step ``s`` is durable on every rank:
       ``checkpointed(s)`` (``after_checkpoint`` releases the held steps ``<= s``).
    4. a restarted trainer (``trainer.resume``): every rank gets the plan (``resume_plan``, collective) and
       passes it to ``steps(resume=plan)``; or calls ``resume(plan)`` before its first step, and
       ``skip_step`` instead of ``run_step`` for a step of ``plan.skipped``.
    5. every rank after its last step: ``finish()`` (collective: waits for the last release and
       returns its counts), then ``close()``; after an error only ``close()``.

    Args:
        store: the run's store, created in this process.
        fields: the run's field shapes.
        storage: fetch and delete concurrency (``StorageConfig.fetch_threads``, ``max_concurrent_deletes``) and
            retries.
        config: topology and timeouts.
        data_group: the process group of the data path's collectives: a gloo group over the whole
            world; default: a new one (``trainer.dist.new_data_group``).
    """

    def __init__(self, store: Store, fields: FieldsConfig, storage: StorageConfig, config: TrainerConfig,
                 data_group: dist.ProcessGroup | None = None):
        self.store, self.fields, self.storage, self.config = store, fields, storage, config
        self.topology = Topology.current(config)
        self.data_group = data_group or new_data_group(config)
        dp_rank = self.topology.dp_rank
        self.ledger = Ledger(store, trainer_actor(dp_rank)) if self.topology.mp_rank == 0 else None
        self.release = (BackgroundRelease(self.ledger, dp_rank, storage.max_concurrent_deletes)
                        if self.ledger is not None else None)
        self.policy = ReleasePolicy(self.release, config) if self.release is not None else None
        self.buffers = BufferPool()
        self.fetch_threads = storage.fetch_threads()
        """Threads of each fetch (``StorageConfig.fetch_threads``)."""
        self.prefetch = Prefetch(self._read_step, self.fetch, config.step_poll_s)
        self._skipped: set[int] = set()
        """Steps of the resume plan (``resume``) that are skipped: never prefetched."""
        self._retries_seen = store.retries

    def run_step(self, step: int, train: Train) -> StepMetrics:
        """Run steps (a)-(h) of the class docstring for ``step``: ``open_step``, ``train``, ``release``.

        Raises:
            StepFileError: the step file did not appear within ``step_timeout_s`` or is invalid.
            ConfigError: the step file's ``dp_world_size`` differs from this world's.
            FetchError: no micro batch of the step could be fetched on any rank (nothing deleted).
            torch.distributed.DistBackendError: a peer died or exceeded ``collective_timeout_s``.
        """
        opened = self.open_step(step)
        train(opened.batches)
        return opened.release()

    def steps(self, stop: int | None = None, *, resume: ResumePlan | None = None) -> Iterator[TrainingStep]:
        """Every rank: the pull loop (``trainer.loop``). Yields steps ``0 .. stop - 1`` (None: without end), each
        a ``TrainingStep`` to train on and then ``release()`` (once, after the optimizer step, on every rank).

        Args:
            resume: a restarted trainer's plan (``resume_plan``): first release what its checkpoint covers
                (``resume``), then yield from ``resume.start_step`` on, the ``resume.skipped`` steps left out
                (never fetched or trained; their chunks released, ``skip_step``), replays flagged ``replayed``.

        Raises (from ``next()``):
            StepOrderError: the next step was asked for before the previous one was released (refused: the loop
                goes on once that step is released); or opening an earlier step raised (every ``next()`` after
                that raises, naming its error).
            The errors of ``run_step``, when a step is opened.
        """
        return PullLoop(self, stop, resume)

    def open_step(self, step: int, *, replayed: bool = False) -> TrainingStep:
        """Every rank, in step order: (a)-(e) of the class docstring for ``step``; the caller trains on its
        ``batches`` and calls its ``release()`` ((g)+(h)). ``steps`` and ``run_step`` call it.

        Raises:
            The errors of ``run_step``.
        """
        started = time.monotonic()
        prepared = self.prefetch.take(step) or self.load_and_fetch(step)
        header, dp_rank = prepared.step_file.header, self.topology.dp_rank
        dropped = self.agree_failures(header, prepared.fetched)
        assembled = self.stand_in_dropped(prepared.step_file, prepared.fetched, dropped[dp_rank])
        hashes = ["" if mb.dropped else prepared.fetched.hashes[mb.index] for mb in assembled]
        batches = [to_torch(mb) for mb in assembled]
        del assembled
        if self.config.prefetch_next_step:
            self.prefetch.start(next(s for s in itertools.count(step + 1) if s not in self._skipped))
        wait_s = max(0.0, prepared.found_at - started)
        exposed_s = time.monotonic() - started - wait_s

        def finish() -> StepMetrics:
            resumed = time.monotonic()
            self.release_step(header)
            return self.metrics(header, prepared, dropped, exposed_s + time.monotonic() - resumed, wait_s, hashes)
        return TrainingStep(header, batches, replayed, finish, self.topology.rank)

    def load_and_fetch(self, step: int) -> Prepared:
        """(a)+(b) on the main thread: wait for step ``step``'s file, then fetch this rank's micro batches."""
        step_file = wait_for_step(self.store, step, timeout_s=self.config.step_timeout_s,
                                  poll_s=self.config.step_poll_s)
        self.check_step(step_file)
        found_at = time.monotonic()
        return Prepared(step_file, self.fetch(step_file), prefetched=False, found_at=found_at)

    def _read_step(self, step: int) -> StepFile:
        """The prefetch's load: read step ``step``'s file once (``KeyNotFoundError`` if not there yet)."""
        step_file = StepFile.read(self.store, step)
        self.check_step(step_file)
        return step_file

    def fetch(self, step_file: StepFile) -> FetchedStep:
        """(b) Fetch and assemble this DP rank's micro batches (never raises; failures become flags) into the
        arrays of earlier steps that nothing refers to any more (``BufferPool.reclaim``)."""
        pause_point("fetch", step_file.header.step)
        self.buffers.reclaim()
        return fetch_own(self.store, step_file, self.topology.dp_rank, self.fields, max_concurrency=self.fetch_threads,
                         buffers=self.buffers)

    def check_step(self, step_file: StepFile) -> None:
        """Check a step file was made for this world's DP size and fields.

        Raises:
            ConfigError: it names another ``dp_world_size`` or other fields.
        """
        if step_file.header.dp_world_size != self.topology.dp_world_size:
            raise ConfigError(f"step file {step_file.uri}: dp_world_size={step_file.header.dp_world_size}, but this "
                              f"world has {self.topology.dp_world_size} DP ranks (world_size="
                              f"{self.topology.world_size}, model_parallel_size={self.config.model_parallel_size})")
        if step_file.header.fields != self.fields:
            raise ConfigError(f"step file {step_file.uri}: fields {step_file.header.fields.model_dump()}, but this "
                              f"trainer was configured with {self.fields.model_dump()}")

    def agree_failures(self, header: StepHeader, fetched: FetchedStep) -> np.ndarray:
        """(c) bool [dp_world_size, micro batches per DP rank]: dropped micro batches, the same on every rank.

        Raises:
            FetchError: every micro batch of the step is dropped (raised on every rank alike).
        """
        per_dp_rank = len(header.micro_batches_of(0))
        dropped = agree_failures(fetched.failed, self.topology, per_dp_rank, self.data_group)
        if dropped.size and dropped.all():
            raise FetchError(f"step {header.step}: none of its {dropped.size} micro batches could be fetched on any "
                             f"rank; dp_rank={self.topology.dp_rank} rank={self.topology.rank} errors: "
                             f"{fetched.errors[:3]}")
        return dropped

    def stand_in_dropped(self, step_file: StepFile, fetched: FetchedStep,
                         dropped: np.ndarray) -> list[AssembledMicroBatch]:
        """(d) This DP rank's micro batches in order, each dropped one replaced by its shape-only stand-in.

        A stand-in repeats the token-domain (routing) rows of the first micro batch that was not dropped, so every
        model-parallel peer builds the same one (peers agree on ``dropped``, not on what they fetched).
        """
        header, dp_rank = step_file.header, self.topology.dp_rank
        mbs = header.micro_batches_of(dp_rank)
        kept = [fetched.assembled[mb.index] for mb in mbs if not dropped[mb.index]]
        token_rows = next((real_token_rows(a) for a in kept if a.record.has_routing), None)
        return [assemble_dropped_micro_batch(mb, step_file.streams(dp_rank, mb.index), seq_len=header.seq_len,
                                             fields=self.fields, token_rows=token_rows)
                if dropped[mb.index] else fetched.assembled[mb.index] for mb in mbs]

    def release_step(self, header: StepHeader) -> None:
        """(g) After the step trained (and after (c) on every rank): the ``mp_rank == 0`` rank hands the step to
        its release policy (``config.release``), which deletes (or retains) the chunks its DP rank owns in the
        background, now or once a checkpoint covers the step; other ranks: no-op."""
        if self.policy is not None:
            self.policy.trained(header)

    def _local_release_counts(self) -> list[float]:
        """This rank's store retries and release counts since the last metrics."""
        retries, self._retries_seen = self.store.retries - self._retries_seen, self.store.retries
        counts = self.release.take_counts() if self.release is not None else ReleaseCounts()
        return [retries, counts.deletes, counts.problems, counts.failures]

    def metrics(self, header: StepHeader, prepared: Prepared, dropped: np.ndarray, exposed_s: float,
                wait_s: float, hashes: list[str]) -> StepMetrics:
        """(h) Gather every rank's counters and micro batch hashes into the step's metrics: one all-gather over the
        data group of a fixed-size byte row per rank (``pack_row``)."""
        fetched = prepared.fetched
        local = np.array([fetched.seconds, exposed_s, wait_s, prepared.prefetched, fetched.chunks, fetched.nbytes,
                          len(fetched.errors), *self._local_release_counts()], np.float64)
        rows = gather_rank_rows(pack_row(local, hashes), self.data_group)
        gathered, digests = unpack_rows(rows, len(local), len(hashes))
        seconds, exposed, wait, prefetched, chunks, nbytes, errors, *release = gathered.T
        mp = self.config.model_parallel_size
        metrics = StepMetrics(
            step=header.step, micro_batches=len(header.micro_batches), dropped_micro_batches=int(dropped.sum()),
            fetched_chunks=int(chunks.sum()), fetched_bytes=int(nbytes.sum()),
            fetch_seconds_mean=float(seconds.mean()), fetch_seconds_max=float(seconds.max()),
            exposed_data_seconds_mean=float(exposed.mean()), exposed_data_seconds_max=float(exposed.max()),
            step_wait_seconds_max=float(wait.max()), prefetched_ranks=int(prefetched.sum()),
            failed_fetches=int(errors.sum()),
            micro_batch_hashes=[["" if dropped[dp, i] else digests[dp * mp, i].tobytes().hex()
                                 for i in range(len(hashes))] for dp in range(self.topology.dp_world_size)],
            **release_metrics(release))
        log.info("step %d trainer metrics: %s", header.step, metrics.model_dump())
        return metrics

    def checkpointed(self, step: int) -> None:
        """Every rank, once a checkpoint covering ``step`` is durable on every rank: ``after_checkpoint``
        releases the held steps ``<= step`` (in the background; counted in the next metrics or ``finish``)."""
        if self.policy is not None:
            self.policy.checkpointed(step)

    def resume_plan(self, checkpoint_step: int | None = None, *, published: int | None = None) -> ResumePlan:
        """Every rank (collective), before its first step after a restart: which steps this life replays,
        skips, or only finishes releasing (``trainer.resume``); rank 0 reads the run, every rank gets its plan.
        Pass the plan to ``steps(resume=plan)``, or act on it with ``resume`` and ``skip_step``.

        Args:
            checkpoint_step: the step the training state this life restored covers (its checkpoint's), -1 for
                the initial weights; None: the run's newest complete refpipe checkpoint (``trainer.checkpoint``).
            published: steps ``0 .. published - 1`` are the earlier lives'; None: the step files there now (pass
                the count taken before this life's orchestrator publishes anything, if it already runs).

        Raises:
            ConfigError: ``checkpoint_step`` is below -1.
        """
        return plan_resume(self.store, self.topology.dp_world_size, self.data_group, published, checkpoint_step)

    def resume(self, plan: ResumePlan) -> None:
        """Every rank, before its first step after a restart: the ``mp_rank == 0`` rank releases the steps
        the checkpoint covers that its DP rank had not released in an earlier life (its own earlier delete
        records count as already released)."""
        self._skipped = set(plan.skipped)
        if self.policy is not None:
            for step in range(plan.released[self.topology.dp_rank] + 1, min(plan.start_step, plan.published)):
                self.policy.release(StepFile.read(self.store, step).header)

    def skip_step(self, step: int, plan: ResumePlan) -> StepMetrics:
        """Every rank, instead of ``run_step`` for a step in ``plan.skipped`` (some of its chunks were deleted
        before the crash): never trained; the ``mp_rank == 0`` rank releases what its DP rank still holds.
        Collective (the metrics all-gather).

        Returns:
            The step's metrics: nothing fetched or trained, ``skipped``, the release counts.
        """
        if self.policy is not None and plan.released[self.topology.dp_rank] < step:
            self.policy.release(StepFile.read(self.store, step).header)
        counts = gather_rank_values(np.array(self._local_release_counts(), np.float64), self.data_group).T
        return StepMetrics(step=step, micro_batches=0, dropped_micro_batches=0, fetched_chunks=0, fetched_bytes=0,
                           fetch_seconds_mean=0.0, fetch_seconds_max=0.0, exposed_data_seconds_mean=0.0,
                           exposed_data_seconds_max=0.0, step_wait_seconds_max=0.0, prefetched_ranks=0,
                           failed_fetches=0, skipped=True,
                           micro_batch_hashes=[], **release_metrics(counts))

    def finish(self) -> ReleaseMetrics:
        """Every rank, after its last step (collective): wait for the pending releases (retrying failed deletes
        once) and gather what was released since the last step's metrics."""
        self.prefetch.take(-1)
        if self.release is not None:
            self.release.wait(retry=True)
        counts = gather_rank_values(np.array(self._local_release_counts()), self.data_group)
        metrics = ReleaseMetrics(**release_metrics(counts.T))
        log.info("trainer release after the last step: %s", metrics.model_dump())
        return metrics

    def close(self) -> None:
        """Clean shutdown of this rank alone (no collective): stop the prefetch, finish the background release
        (``mp_rank == 0``: retry failed deletes once; still failing: logged, the sweep finishes them), close the
        ledger."""
        self.prefetch.close()
        if self.release is not None:
            self.release.shutdown()
            assert self.ledger is not None  # made with the release, on mp_rank 0
            self.ledger.close()
