"""When a DP rank releases a trained step's chunks, and whether it deletes or retains them.

One ``ReleasePolicy`` per DP rank, on its ``mp_rank == 0`` rank (the one that owns the DP rank's
ledger actor ``trainer_dp<r>``), in front of its ``trainer.background.BackgroundRelease``.
Policies (``TrainerConfig.release``):

- ``after_step``: a step's chunks are released right after the step is trained;
- ``after_checkpoint``: the step is recorded as ``trained`` (the ledger event the audit shows as
  held by ``trainer_dp<r>``, "trained, awaiting checkpoint") and its chunks stay until
  ``checkpointed(step)`` says a checkpoint covering it is durable on every rank, so a crash
  after the last checkpoint can replay the steps after it from their step files.

Releasing a step deletes its owned chunks in the background, except for steps in
``retain_steps``: their chunks are handed to the ``retained`` holder (a ``retain`` event naming
them) and stay for ``refpipe show``/``verify`` until ``refpipe sweep --retained``. Either way the
``release`` event (step, dp_rank) then says this DP rank is done with the step.
"""

from __future__ import annotations

from refpipe.pipeline.step_header import StepHeader
from refpipe.trainer.background import BackgroundRelease
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.pause import pause_point


class ReleasePolicy:
    """Release policy of one DP rank (``mp_rank == 0`` only); see the module doc.

    Args:
        background: the DP rank's background release (its ledger is ``trainer_dp<dp_rank>``).
        config: ``release`` and ``retain_steps``.
    """

    def __init__(self, background: BackgroundRelease, config: TrainerConfig):
        self.background, self.config = background, config
        self.ledger, self.dp_rank = background.ledger, background.dp_rank
        self.held: list[StepHeader] = []
        """Trained steps awaiting a checkpoint (``after_checkpoint``), oldest first."""

    def trained(self, header: StepHeader) -> None:
        """The step is trained on every rank: release it now (``after_step``), or hold it."""
        if self.config.release == "after_step":
            self.release(header)
            return
        self.held.append(header)
        self.ledger.record("trained", step=header.step, dp_rank=self.dp_rank)
        self.ledger.flush()

    def checkpointed(self, step: int) -> None:
        """A checkpoint covering ``step`` is durable on every rank: release every held step ``<= step``."""
        while self.held and self.held[0].step <= step:
            self.release(self.held.pop(0))

    def release(self, header: StepHeader) -> None:
        """Start releasing this DP rank's owned chunks of ``header``'s step in the background: deleted, or (a
        retained step) handed to the ``retained`` holder. Waits only for the releases before the latest pending one
        (``BackgroundRelease.submit``)."""
        if self.dp_rank == 1:
            pause_point("release_dp1", header.step)
        refs = header.owned_refs(self.dp_rank)
        if self.config.retains(header.step):
            self.ledger.record("retain", step=header.step, dp_rank=self.dp_rank,
                               branch_ids=[c.branch_id for r in refs for c in r.chunks])
            refs = []
        self.background.submit(header.step, refs)
