"""The trainer as the orchestrator role sees it: the steps it trained, what they cost, and whether it died.

The trainer ranks run elsewhere (``refpipe run``'s subprocesses or torchrun on other nodes); rank 0
writes ``<run>/metrics/step_<N>.json`` after each step and ``<run>/metrics/finish.json`` at its end
(``job.train_rank``). ``TrainerProgress`` reads those as they appear: one progress line and one
``StepCost`` per trained step, the trainer's deletes and alignment into the run's tally. A dead rank
is known by ``Fleet.dead_trainers`` (its process, or its ledger session's heartbeat).
"""

from __future__ import annotations

import json
import time

from rich.console import Console

from refpipe.job.config import RunConfig
from refpipe.job.fleet import Fleet
from refpipe.job.progress import ProgressView, StepRow
from refpipe.job.report import RunTally, StepCost
from refpipe.job.train_rank import checkpoint_due
from refpipe.pipeline.orchestrator import Orchestrator
from refpipe.storage.errors import KeyNotFoundError, RunError
from refpipe.storage.layout import FINISH_METRICS_KEY, metrics_key
from refpipe.storage.store import Store
from refpipe.trainer.resume import ResumePlan


class TrainerProgress:
    """Steps built but not yet trained, and the trainer's metrics of each as it finishes it.

    The orchestrator role's main thread calls ``built`` for every step it publishes, ``poll`` once per
    loop round, ``check`` to fail fast on a dead rank, and ``finished`` at the end of the run.
    """

    def __init__(self, cfg: RunConfig, store: Store, console: Console, view: ProgressView, tally: RunTally):
        self.cfg, self.store, self.console, self.view, self.tally = cfg, store, console, view, tally
        self.trained = 0
        """Steps ``0 .. trained - 1`` are trained (their metrics arrived, in this life or an earlier one)."""
        self.rows: dict[int, StepRow] = {}
        """Built steps not yet trained -> their progress line so far (the orchestrator's side)."""
        self.plan: ResumePlan | None = None
        """A later life's resume plan (``trainer.resume.read_plan``): which of its steps are replayed or skipped."""
        self.stale_lives: dict[int, str | None] = {}
        """Steps to train again -> the ``life`` of their metrics from an earlier life (not this life's)."""
        self.shipped_nbytes: dict[int, int] = {}  # step -> bytes of its chunks, until its release is counted
        self.released_nbytes = 0

    def built(self, row: StepRow, shipped_nbytes: int) -> None:
        """Step ``row.step`` was published; its chunks hold ``shipped_nbytes`` bytes."""
        self.rows[row.step] = row
        self.shipped_nbytes[row.step] = shipped_nbytes

    def poll(self, orchestrator: Orchestrator) -> bool:
        """Show the trainer's metrics of every step it finished since the last look; return whether any."""
        progressed = False
        tally = self.tally
        while self.trained in self.rows:
            try:
                metrics = json.loads(self.store.get(metrics_key(self.trained)))
            except KeyNotFoundError:
                return progressed
            if self.trained in self.stale_lives and metrics.get("life") == self.stale_lives[self.trained]:
                return progressed  # an earlier life's metrics: this life has not trained the step yet
            if self.plan and (self.trained in self.plan.skipped or self.plan.replays(self.trained)):
                tally.lives["skipped" if self.trained in self.plan.skipped else "replayed"] += 1
            tally.deletes["trainer"] += metrics["deletes"]
            tally.alignment_max = max(tally.alignment_max, metrics["on_policy_max_abs_diff"])
            tally.alignment_tokens += metrics["on_policy_tokens"]
            deletes = (sum(orchestrator.deleted.values()), tally.deletes["trainer"],
                       tally.deletes["env worker discard"])
            row = self.rows.pop(self.trained)
            self.view.step_done(row.with_trainer(metrics, deletes))
            self._record_cost(self.trained, row.reward, metrics, deletes, orchestrator.deleted_nbytes)
            self.trained, progressed = self.trained + 1, True
        return progressed

    def _record_cost(self, step: int, reward: float, metrics: dict, deletes: tuple[int, int, int],
                     orchestrator_deleted_nbytes: int) -> None:
        """One ``StepCost``: step ``s``'s metrics count the release of step ``s - 1`` (run in the background), which
        with ``release = "after_checkpoint"`` is the release of every step a checkpoint of step ``s - 1`` covers;
        until then a trained step's chunks are held for a checkpoint."""
        after_checkpoint = self.cfg.trainer.release == "after_checkpoint"
        if not after_checkpoint or checkpoint_due(self.cfg, step - 1):
            for released in [s for s in self.shipped_nbytes if s < step]:
                self.released_nbytes += self.shipped_nbytes.pop(released)
        in_flight = self.tally.kept_bytes - orchestrator_deleted_nbytes - self.released_nbytes
        held = sum(n for s, n in self.shipped_nbytes.items() if s <= step) if after_checkpoint else 0
        self.tally.costs.steps.append(StepCost(
            step=step, reward=reward, exposed_data_seconds=metrics["exposed_data_seconds_max"],
            fetch_seconds=metrics["fetch_seconds_max"], step_wait_seconds=metrics["step_wait_seconds_max"],
            kept_bytes_in_flight=in_flight, held_for_checkpoint_bytes=held,
            deletes=dict(zip(("orchestrator", "trainer", "env worker discard"), deletes))))

    def check(self, fleet: Fleet) -> None:
        """Raise if a trainer rank is known dead (``Fleet.dead_trainers``), naming it and what to do next.

        Raises:
            RunError: a trainer rank died.
        """
        dead = fleet.dead_trainers()
        if dead:
            raise RunError(f"trainer dead: {'; '.join(dead)}. The run cannot go on: stop its other roles (env-server "
                           f"replicas, trainer ranks), then continue it from its newest checkpoint with "
                           f"`refpipe run --resume {self.store.prefix.uri}` (unless a trainer rank's own error "
                           f"says a resume meets it again)")

    def wait_for_finish(self, fleet: Fleet) -> str | None:
        """Roles started elsewhere: wait (up to ``job.step_deadline_s``) until rank 0 wrote the trainer's
        finish metrics, i.e. every rank finished its last release, before the final sweep and audit; return
        why the run failed meanwhile (a trainer rank died), else None."""
        deadline = time.monotonic() + self.cfg.job.step_deadline_s
        while not self.store.exists(FINISH_METRICS_KEY) and time.monotonic() < deadline:
            try:
                self.check(fleet)
            except RunError as e:
                self.console.log(f"[red]run stopped: {e}")
                return f"RunError: {e}"
            time.sleep(0.5)
        return None

    def finished(self) -> None:
        """Count the trainer's last release and its ranks' peak RSS (nothing if it did not finish)."""
        try:
            finished = json.loads(self.store.get(FINISH_METRICS_KEY))
        except KeyNotFoundError:
            return
        self.tally.deletes["trainer"] += finished["deletes"]
        for rank, nbytes in enumerate(finished["peak_rss_bytes"]):
            self.tally.costs.process_rss(f"trainer_rank_{rank}", nbytes)
