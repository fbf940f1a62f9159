"""Where a restarted trainer picks up: which steps it replays, skips, or only finishes releasing.

A run has lives; each trainer rank's ledger session is one life of its DP rank's actor
(``trainer_dp<r>``). When a later life starts, the run holds:

- the training state the life restored: the step ``k`` its checkpoint covers (refpipe's newest complete
  checkpoint, ``storage.checkpoints.newest_checkpoint``, or the caller's own), or none (``k = -1``: the
  initial weights, step 0);
- step files ``0 .. published - 1``;
- per DP rank, the highest step it released in an earlier life (its ``release`` events).

From these: steps ``<= k`` are covered by the checkpoint; a DP rank that had not released one
of them releases it now (its own earlier delete and release records count as already released).
Steps ``k + 1 .. published - 1`` are trained again from their step files (a replay), except a
step some of whose chunks already have a delete record, or with a release record (``release = "after_step"``
deleted them before the crash): it is skipped, never trained on stand-ins, and its remaining chunks released.

A step one DP rank released and another did not is handled per DP rank by the same rules. A release
comes after the caller's gradient all-reduce and optimizer step (``TrainingStep.release``), so once
any DP rank released a step, every DP rank's samples of it were trained in that life: covered by
the checkpoint, the unreleased DP rank releases its chunks; not covered, the step is skipped on
every DP rank and the unreleased one releases its chunks. Either way no sample is trained twice;
samples of a skipped step are not in this life's weights (``release = "after_checkpoint"``, or a
checkpoint before every release, keeps every trained step covered or replayable).

``plan_resume`` is collective: rank 0 reads the run (``read_plan``) and broadcasts the plan, so every rank
acts on the same one. ``published`` is fixed when the life starts: the launcher of ``refpipe run --resume``
reads the same plan before it starts anything (``read_plan``) and hands its ``published`` to the ranks
(``--published``), because its orchestrator publishes the life's new steps while the ranks start; a step
this life published is trained for the first time, never replayed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from refpipe.pipeline.step_file import StepFile
from refpipe.storage.checkpoints import newest_checkpoint
from refpipe.storage.errors import ConfigError
from refpipe.storage.layout import (
    EVENTS_PREFIX,
    STEPS_PREFIX,
    parse_step_key,
    release_prefix,
    tombstone_key,
    trainer_actor,
)
from refpipe.storage.ledger_records import batch_claimed, read_segment
from refpipe.storage.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePlan:
    """What a restarted trainer does before and while it trains, the same on every rank
    (``TrainerRank.resume_plan``; ``TrainerRank.steps(resume=plan)`` acts on it).

    A custom loop restores its state from the checkpoint of ``checkpoint_step`` (or its initial weights),
    then trains ``start_step, start_step + 1, ...`` except the ``skipped`` steps; ``replayed`` are the ones
    an earlier life published (and maybe trained): the same step files, trained again from the restored state.
    """

    checkpoint_step: int
    """The step the restored training state covers (its checkpoint's), or -1 (the initial weights)."""
    published: int
    """Steps ``0 .. published - 1`` have a step file."""
    released: dict[int, int]
    """DP rank -> highest step it released in an earlier life (-1: none)."""
    skipped: list[int]
    """Steps ``>= start_step`` with a chunk already deleted: not trained again."""

    @property
    def start_step(self) -> int:
        """The first step to train: ``checkpoint_step + 1``."""
        return self.checkpoint_step + 1

    @property
    def diverged_from(self) -> int | None:
        """The lowest policy version whose weights in this life differ from an earlier life's of that number, or
        None. A skipped step ``s`` is not trained, yet its weights are named ``s + 1`` as the earlier life named its
        trained ones, so every version ``> min(skipped)`` differs; a replayed step gives the earlier weights
        exactly (``job.weights.check_same_weights``). Samples of such versions in the step files an earlier life
        published (``step < published``) were taken with weights this life does not have: off-policy."""
        return min(self.skipped) + 1 if self.skipped else None

    def replays(self, step: int) -> bool:
        """Whether training ``step`` is a replay of a step an earlier life published (and maybe trained)."""
        return self.start_step <= step < self.published and step not in self.skipped

    @property
    def replayed(self) -> list[int]:
        """The steps ``replays`` is true of: ``start_step .. published - 1`` but the skipped ones."""
        return [step for step in range(self.start_step, self.published) if step not in self.skipped]

    def describe(self) -> str:
        """One line: where the life starts and what it does with the steps an earlier life published after it,
        e.g. ``from the checkpoint of step 1: steps 2..3 of an earlier life: 1 replayed (3), 1 skipped (2: a chunk
        already deleted)``."""
        start = (f"from the checkpoint of step {self.checkpoint_step}" if self.checkpoint_step >= 0
                 else "from the warm start")
        if self.start_step >= self.published:
            return f"{start}: no step of an earlier life after it"
        return (f"{start}: steps {self.start_step}..{self.published - 1} of an earlier life: {len(self.replayed)} "
                f"replayed ({_steps(self.replayed)}), {len(self.skipped)} skipped ({_steps(self.skipped)}"
                f"{': a chunk already deleted' if self.skipped else ''})")


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) or "none"


def plan_resume(store: Store, dp_world_size: int, group: dist.ProcessGroup, published: int | None = None,
                checkpoint_step: int | None = None) -> ResumePlan:
    """Every rank: rank 0 reads the run (``read_plan``) and broadcasts the plan over ``group`` (the data path's
    gloo group, ``TrainerRank.data_group``).

    Raises:
        ConfigError: ``checkpoint_step`` is below -1 (on every rank, before the broadcast).
    """
    _check_checkpoint_step(checkpoint_step)
    box = [read_plan(store, dp_world_size, published, checkpoint_step) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    plan = box[0]
    assert plan is not None  # rank 0's plan, now on every rank
    return plan


def read_plan(store: Store, dp_world_size: int, published: int | None = None,
              checkpoint_step: int | None = None) -> ResumePlan:
    """The plan of the run's next life, read-only: one listing each of ``checkpoints/``, ``steps/`` (unless
    ``published`` is given) and each ``ledger/events/trainer_dp<r>/``; every segment of those actors; per step after
    the checkpoint, one listing of its release records and (none found) one HEAD per chunk.

    Args:
        published: steps ``0 .. published - 1`` are the earlier lives' (what the launcher found before this life
            started); None: the step files listed now, up to the first missing one.
        checkpoint_step: the step the restored training state covers (-1: none); None: the newest complete
            refpipe checkpoint's (``storage.checkpoints.newest_checkpoint``; none: -1).

    Raises:
        ConfigError: ``checkpoint_step`` is below -1.
    """
    _check_checkpoint_step(checkpoint_step)
    if checkpoint_step is None:
        checkpoint = newest_checkpoint(store)
        checkpoint_step = checkpoint.step if checkpoint else -1
    if published is None:
        steps = {s for k in store.list_prefix(STEPS_PREFIX) if (s := parse_step_key(k)) is not None}
        published = next(s for s in range(len(steps) + 1) if s not in steps)
    released = {r: _highest_release(store, r) for r in range(dp_world_size)}
    skipped = [s for s in range(checkpoint_step + 1, published) if _some_chunk_deleted(store, s)]
    return ResumePlan(checkpoint_step, published, released, skipped)


def _check_checkpoint_step(checkpoint_step: int | None) -> None:
    if checkpoint_step is not None and checkpoint_step < -1:
        raise ConfigError(f"checkpoint_step={checkpoint_step}: expected the step a checkpoint covers, or -1 for none")


def _highest_release(store: Store, dp_rank: int) -> int:
    """The highest step DP rank ``dp_rank`` recorded a ``release`` of in any life (-1: none). An unreadable
    record is skipped with a warning: at worst the rank releases a step again, and its own earlier delete
    records make that a no-op, never a double delete."""
    highest = -1
    for key in store.list_prefix(f"{EVENTS_PREFIX}/{trainer_actor(dp_rank)}"):
        for number, event in read_segment(store.get(key)):
            if isinstance(event, dict) and event["event"] == "release" and type(event.get("step")) is int:
                highest = max(highest, event["step"])
            elif isinstance(event, ValueError) or event["event"] == "release":
                log.warning("%s line %d: not a readable ledger event (%s): skipped", store.uri(key), number, event)
    return highest


def _some_chunk_deleted(store: Store, step: int) -> bool:
    """Whether a release record of the step (``Ledger.release`` on S3), a delete record of one of its chunks, or a
    filesystem's delete batch record listing one exists."""
    if store.list_prefix(release_prefix(step)):
        return True
    refs = StepFile.read(store, step).header.refs
    return any(store.exists(tombstone_key(ref.branch_id)) for ref in refs) or \
        bool(batch_claimed(store, {c.branch_id for ref in refs for c in ref.chunks}))
