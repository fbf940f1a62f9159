"""A trainer rank's pull loop: the caller asks for each step's micro batches and says when it may be released.

``TrainerRank.steps`` yields one ``TrainingStep`` per step; the caller trains on its ``batches`` (its
forward/backward, its gradient all-reduce, its optimizer step, a checkpoint if it writes one) and then calls
``release()``. The data path and its collectives are ``TrainerRank.run_step``'s, which is this loop with a
callback: (a)-(e) when the step is yielded, (g)+(h) at ``release()``, in the same order on every rank.

``StepDataset`` is the same loop as a ``torch.utils.data.IterableDataset``, for a training loop that reads
its batches from a ``DataLoader(dataset, batch_size=None)`` (in the rank's own process: ``num_workers=0``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from torch.utils.data import IterableDataset, get_worker_info

from refpipe.pipeline.step_header import StepHeader
from refpipe.storage.errors import ConfigError, StepOrderError
from refpipe.trainer.resume import ResumePlan
from refpipe.trainer.tensors import TrainMicroBatch

if TYPE_CHECKING:
    from refpipe.trainer.metrics import StepMetrics
    from refpipe.trainer.step import TrainerRank


class TrainingStep:
    """One step of a trainer rank's pull loop, fetched, agreed on and assembled (steps (a)-(e) of
    ``TrainerRank``); every rank gets one per step, in the same order.

    Which ranks call what: every rank trains on ``batches``, then calls ``release()`` exactly once, after its
    optimizer step (after the gradient all-reduce, so every DP rank has trained the step; and after the
    step's checkpoint, if the caller writes one before releasing). ``release()`` is collective (the metrics
    all-gather over the data group); the ``mp_rank == 0`` rank of each DP rank hands the step to its release
    policy (``TrainerConfig.release``), which deletes the chunks its DP rank owns now or once
    ``TrainerRank.checkpointed`` covers the step.
    """

    def __init__(self, header: StepHeader, batches: list[TrainMicroBatch], replayed: bool,
                 finish: Callable[[], StepMetrics], rank: int):
        self.header = header
        """The step file's header: its micro batches' sequences and the refs (``refs[seq.ref]``) they use."""
        self.batches = batches
        """This rank's micro batches of the step, in order (``micro_batches_of(dp_rank)``). A dropped one
        (some rank could not fetch it) keeps its shapes, has an all-False ``loss_mask`` and ``dropped`` set:
        run it through the model so model-parallel collectives stay in step, and keep it out of the loss."""
        self.replayed = replayed
        """A step an earlier life published (and maybe trained), trained again after a restart
        (``ResumePlan.replays``)."""
        self.metrics: StepMetrics | None = None
        """The step's metrics, identical on every rank, once ``release()`` returned."""
        self._finish, self._rank = finish, rank

    @property
    def step(self) -> int:
        """The step number."""
        return self.header.step

    def release(self) -> StepMetrics:
        """Every rank, once, after its optimizer step: (g) release and (h) metrics (collective). Drops this
        object's references to ``batches`` (their arrays are reused by a later step's fetch once nothing else
        refers to them).

        Raises:
            StepOrderError: the step was released already.
            torch.distributed.DistBackendError: a peer died or exceeded ``collective_timeout_s``.
        """
        if self.metrics is not None:
            raise StepOrderError(f"step {self.step} was already released on rank {self._rank}: release() is called "
                                 f"once per step, after the optimizer step")
        self.batches = []
        self.metrics = self._finish()
        return self.metrics


class PullLoop(Iterator[TrainingStep]):
    """The iterator ``TrainerRank.steps`` returns: each ``next()`` opens the next step (see there).

    A refused ``next()`` changes nothing: asked for before the previous step's ``release()``, it raises
    ``StepOrderError`` and the loop goes on once that step is released. Once opening a step raised (a fetch
    failure, a step file's timeout, a collective's error), every later ``next()`` raises ``StepOrderError``
    naming that error: the loop never ends silently short of ``stop``.
    """

    def __init__(self, rank: TrainerRank, stop: int | None, resume: ResumePlan | None):
        self._rank, self._stop, self._resume = rank, stop, resume
        self._step = resume.start_step if resume is not None else 0
        self._resumed = resume is None
        self._opened: TrainingStep | None = None
        self._failed: Exception | None = None

    def __next__(self) -> TrainingStep:
        rank = self._rank.topology.rank
        if self._opened is not None and self._opened.metrics is None:
            raise StepOrderError(f"step {self._opened.step} was not released on rank {rank} before the next step "
                                 f"was asked for: call release() after the step's optimizer step, on every rank")
        if self._failed is not None:
            raise StepOrderError(f"the pull loop of rank {rank} ended at step {self._step}, which failed to open "
                                 f"({type(self._failed).__name__}: {self._failed}); restart the trainer "
                                 f"(resume_plan) to go on") from self._failed
        try:
            opened = self._open_next()
        except Exception as e:
            self._failed = e
            raise
        if opened is None:
            raise StopIteration
        return opened

    def _open_next(self) -> TrainingStep | None:
        """Resume (first call), skip ``resume.skipped`` steps, open the next step; None past ``stop``."""
        resume = self._resume
        if not self._resumed and resume is not None:
            self._rank.resume(resume)
            self._resumed = True
        while resume is not None and self._step in resume.skipped and self._before_stop():
            self._rank.skip_step(self._step, resume)
            self._step += 1
        if not self._before_stop():
            return None
        self._opened = self._rank.open_step(self._step, replayed=resume is not None and resume.replays(self._step))
        self._step += 1
        return self._opened

    def _before_stop(self) -> bool:
        return self._stop is None or self._step < self._stop


class StepDataset(IterableDataset):
    """``TrainerRank.steps(stop, resume=resume)`` as an ``IterableDataset``: each item is a ``TrainingStep``.

    Use it with ``DataLoader(dataset, batch_size=None)`` (items pass through as they are) in the trainer
    rank's own process (``num_workers=0``: the loop joins the data group's collectives); call each item's
    ``release()`` after its optimizer step. Iterate it once.

    Raises (when iterated):
        ConfigError: iterated in a ``DataLoader`` worker process (``num_workers > 0``).
    """

    def __init__(self, rank: TrainerRank, stop: int | None = None, *, resume: ResumePlan | None = None):
        self.rank, self.stop, self.resume = rank, stop, resume

    def __iter__(self) -> Iterator[TrainingStep]:
        if get_worker_info() is not None:
            raise ConfigError("StepDataset: iterated in a DataLoader worker process; expected num_workers=0 (the "
                              "steps' fetch and collectives belong to the trainer rank's own process)")
        return self.rank.steps(self.stop, resume=self.resume)
