"""The orchestrator role (``refpipe orchestrate``) and ``refpipe run``, its one-machine composition.

``Launcher.orchestrate`` is the orchestrator of a run that ``refpipe init`` prepared: it
connects to the ``job.num_env_workers`` env-server replicas (``job.fleet``), then loops over
named steps until every step was trained:

    check processes -> dispatch group requests -> collect episodes -> build a step -> show progress

Then it stops the replicas, shuts the orchestrator down, sweeps what dead replicas left
behind, and ends with the ledger audit. The exit code is non-zero when the audit or the
alignment check fails.

``Launcher.run`` (``refpipe run``) is the same on one machine: it initialises the run
(``job.roles.write_run_config``, warm start, weights version 0), starts the env-server replicas
and the trainer ranks as subprocesses running the commands an operator would start
(``job.roles.start_local_roles``), and orchestrates in its own process.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import replace

import torch
from rich.console import Console

from refpipe.job.config import RunConfig
from refpipe.job.env_worker import GroupRequest, GroupResult
from refpipe.job.fleet import Fleet, connect_fleet, stop_fleet
from refpipe.job.model import MoELM
from refpipe.job.progress import ProgressView, StepRow
from refpipe.job.report import RunCosts, StepCost
from refpipe.job.resume import LifeStart
from refpipe.job.roles import start_local_roles, write_run_config
from refpipe.job.task import warm_start
from refpipe.job.text import markup_safe
from refpipe.job.train_rank import checkpoint_due
from refpipe.job.weights import point_latest, publish_weights
from refpipe.pipeline.audit import AuditReport, audit, sweep
from refpipe.pipeline.orchestrator import Orchestrator
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.errors import (
    ConfigError,
    KeyNotFoundError,
    LedgerRecordError,
    RefpipeError,
    RunError,
    RunStillRunningError,
    TransientStorageError,
)
from refpipe.storage.layout import (
    CONFIG_KEY,
    FINISH_METRICS_KEY,
    REPORT_KEY,
    STEPS_PREFIX,
    SUMMARY_KEY,
    metrics_key,
    step_key,
)
from refpipe.storage.store import Store
from refpipe.trainer.resume import ResumePlan, read_plan

MAX_GROUP_ATTEMPTS = 3
"""Sends of one group (the first and its re-sends after a failed keep or a dead worker) before the run fails."""


class Launcher:
    """Drives one run; see the module docstring for the order of things."""

    def __init__(self, cfg: RunConfig, console: Console, *, resume: bool = False):
        self.cfg, self.console, self.resume = cfg, console, resume
        self.store: Store = open_store(cfg.storage)
        self.view = ProgressView(console, cfg)
        self.orchestrator: Orchestrator | None = None
        self.next_request, self.next_step, self.trained = 0, 0, 0
        self.deletes: Counter[str] = Counter()
        self.kept_chunks = self.kept_bytes = 0
        self.alignment_max = 0.0
        self.signals: list[int] = []
        """SIGINT (Ctrl-C) and SIGTERM received by ``run``/``orchestrate`` in the main thread: the first sets the
        exit code, 128 + its number (the shell's convention)."""
        self.alignment_tokens = 0
        self.rewards: list[float] = []
        self.rows: dict[int, StepRow] = {}
        self.life: LifeStart | None = None
        self.plan: ResumePlan | None = None
        """A later life's resume plan (``trainer.resume.read_plan``), read before any role starts; its trainer ranks
        get its ``published`` (``--published``), so they replay and skip the same steps."""
        self.stale_lives: dict[int, str | None] = {}
        """Steps to train again -> the ``life`` of their metrics from an earlier life (not this life's)."""
        self.lives: Counter[str] = Counter()
        """This life's ``replayed`` and ``skipped`` steps so far (of ``plan.replayed`` and ``plan.skipped``, counted as
        their metrics arrive) and ``reclaimed`` chunks (``refpipe run --resume``)."""
        self.costs = RunCosts()
        self.shipped_nbytes: dict[int, int] = {}  # step -> bytes of its chunks, until its release is counted
        self.released_nbytes = 0

    def run(self) -> int:
        """``refpipe run``: initialise the run, start the replicas and trainer ranks here, orchestrate;
        return the process exit code (0: audit clean and alignment within tolerance)."""
        with _signals_as_interrupt(self.signals):  # SIGTERM before the fleet exists ends like Ctrl-C
            if self.resume:
                self.prepare_resume()
            else:
                self.prepare()
            env_procs, trainers = start_local_roles(self.cfg, self.store.prefix.uri, _free_port(),
                                                    published=self.plan.published if self.plan else None)
            return self.orchestrate(env_procs, trainers)

    def orchestrate(self, env_procs: list | None = None, trainers: list | None = None) -> int:
        """``refpipe orchestrate``: connect to the replicas, drive the run, audit it; return the exit code.

        ``env_procs``/``trainers``: the subprocesses ``run`` started (watched, stopped); none when the
        roles run elsewhere, in which case the trainer's end is read from the run.
        """
        with _signals_as_interrupt(self.signals):
            try:  # the orchestrator's ledger session first: a second live orchestrator is refused at once
                self.orchestrator = Orchestrator(self.cfg.orchestrator, self.store, fields=self.cfg.fields)
                fleet = connect_fleet(self.store, self.cfg.job.num_env_workers, self.cfg.job.step_deadline_s,
                                      env_procs or [], trainers or [], self.cfg.orchestrator.dp_world_size)
            except (RefpipeError, TimeoutError, KeyboardInterrupt) as e:
                for proc in (env_procs or []) + (trainers or []):
                    proc.kill()
                if self.orchestrator is not None:
                    self.orchestrator.shutdown()
                if isinstance(e, TimeoutError):
                    raise RunError(str(e)) from e
                raise
            failure = self.drive(fleet)
        if not trainers and failure is None:
            failure = self._wait_for_trainer_finish(fleet)
        return self.finish(fleet, failure=failure)

    @property
    def running_orchestrator(self) -> Orchestrator:
        """The orchestrator ``orchestrate`` made; everything after that reads it here."""
        assert self.orchestrator is not None, "orchestrate() makes the orchestrator first"
        return self.orchestrator

    def drive(self, fleet: Fleet) -> str | None:
        """Loop until done, then stop the fleet and shut the orchestrator down; return why the run failed."""
        failure = None
        try:
            self.loop(fleet)
        except RefpipeError as e:
            failure = f"{type(e).__name__}: {e}"
        except KeyboardInterrupt:
            failure = f"interrupted ({signal.Signals(self.signals[0]).name})" if self.signals else "interrupted"
        finally:
            if failure:
                self.console.log(f"[red]run stopped: {failure}")
            stop_fleet(fleet, self.collect, failed=failure is not None)
            self.running_orchestrator.shutdown()
            self.deletes.update({f"orchestrator {k}": v for k, v in self.running_orchestrator.deleted.items()})
        return failure

    def prepare(self) -> None:
        """``refpipe init``: write the resolved config and the auth key next to the data, then publish the
        warm-started weights (version 0).

        Raises:
            ConfigError: the run already exists (nothing is written).
        """
        self.cfg = write_run_config(self.cfg, self.store)
        torch.set_num_threads(1)
        model = MoELM(self.cfg.model)
        with self.console.status(f"warm start: {self.cfg.job.warm_start_steps} supervised steps"):
            losses = warm_start(model, self.cfg.task, steps=self.cfg.job.warm_start_steps)
        if losses:
            self.console.log(f"warm start done: loss {losses[0]:.3f} -> {losses[-1]:.3f} nats/token")
        publish_weights(self.store, model, 0)
        self.console.log(f"run {self.store.prefix.uri}: {self.cfg.job.num_env_workers} env-server replicas, "
                         f"{self.cfg.job.trainer_world_size} trainer ranks, {self.cfg.job.num_steps} steps")

    def prepare_resume(self) -> None:
        """A later life (``job.resume``): reclaim what dead sessions kept but never shipped (refused while a session
        of the run is live by its heartbeat, on any host), point env workers at the checkpoint's weights, save the
        resumed config, and go on numbering after the last published step."""
        life = LifeStart.read(self.store, self.cfg.job.num_steps)
        try:
            swept = sweep(self.store, stopped=True)
            self.lives["reclaimed"] = len(swept.deleted) + len(swept.removed_incomplete) + len(swept.finished_deletes)
            self.deletes["sweep at resume"] += len(swept.deleted)
        except RunStillRunningError as e:
            raise ConfigError(f"refusing to resume {self.store.prefix.uri}: another life of the run is still running: "
                              f"{', '.join(e.running)} (heartbeats live); stop it (on every node) first") from e
        except LedgerRecordError as e:  # the run goes on; its audit reports the record, nothing is reclaimed
            self.console.log(f"[yellow]not reclaiming what dead sessions kept:[/] {markup_safe(str(e))}")
        self.plan = read_plan(self.store, self.cfg.orchestrator.dp_world_size, life.published)  # after the sweep
        point_latest(self.store, life.policy_version)
        self.store.put(CONFIG_KEY, self.cfg.model_dump_json(indent=2).encode())
        self.life, self.trained, self.next_step = life, life.checkpoint_step + 1, life.published
        sizes = self.store.list_sizes(STEPS_PREFIX)
        for step in range(self.trained, life.published):
            self.rows[step] = StepRow.from_header(StepFile.read(self.store, step).header, sizes[step_key(step)], 0, 0)
            with contextlib.suppress(KeyNotFoundError):
                self.stale_lives[step] = json.loads(self.store.get(metrics_key(step))).get("life")
        self.console.log(f"resuming run {self.store.prefix.uri} (life {life.life}) {self.plan.describe()}; steps "
                         + "; ".join(f"{k} {len(v)}" for k, v in life.classes.items())
                         + f"; {self.lives['reclaimed']} chunks reclaimed from dead sessions", highlight=False)

    def loop(self, fleet: Fleet) -> None:
        """Until every step is trained: check, dispatch, collect, build, show."""
        deadline = time.monotonic() + self.cfg.job.step_deadline_s
        with self.view:
            while self.trained < self.cfg.job.num_steps:
                self.check_trainers(fleet)
                self.dispatch(fleet)
                self.collect(fleet, timeout_s=0.1)
                progressed = self.build_step() | self.poll_trainer()
                if progressed:
                    deadline = time.monotonic() + self.cfg.job.step_deadline_s
                elif time.monotonic() > deadline:
                    raise RunError(f"no progress for {self.cfg.job.step_deadline_s:.0f} s at step {self.next_step} "
                                   f"(trained {self.trained}, ready groups {self.running_orchestrator.ready_groups})")

    def dispatch(self, fleet: Fleet) -> None:
        """Request groups from the live workers with the fewest in flight, as many as the steps that can
        still train them need: a group sampled now has policy version >= ``self.trained``, so it serves
        steps up to ``self.trained + max_async_level``; more would only go stale."""
        orch = self.cfg.orchestrator
        last_step = min(self.trained + orch.max_async_level, self.cfg.job.num_steps - 1)
        limit = (last_step - self.next_step + 1) * orch.groups_per_step
        while sum(len(f) for f in fleet.in_flight) + self.running_orchestrator.ready_groups < limit:
            every = self.cfg.job.eval_every_steps
            is_eval = bool(every) and self.next_request % (every * self.cfg.orchestrator.groups_per_step) == 1
            prefix = f"l{self.life.life}-" if self.life else ""  # a later life never reuses a branch id
            self.send(fleet, GroupRequest(self.next_request, f"{prefix}g{self.next_request:06d}", self.next_request,
                                          is_eval))
            self.next_request += 1

    def send(self, fleet: Fleet, request: GroupRequest) -> None:
        """Send to the live replica with the fewest groups in flight (a replica whose connection is gone
        is declared dead and the next one tried)."""
        while True:
            live = [w for w in fleet.live() if w not in fleet.dead]
            if not live:
                raise RunError("every env-server replica died; see the log above")
            worker = min(live, key=lambda w: len(fleet.in_flight[w]))
            if fleet.send(worker, request):
                fleet.in_flight[worker][request.request_id] = request
                return
            fleet.close(worker)  # never reached: the next live replica gets it below, not a re-dispatch too
            self.lost(fleet, worker)

    def lost(self, fleet: Fleet, worker: int) -> None:
        """A replica's connection ended: while running, it died (its groups go to the others)."""
        if fleet.stopping or worker in fleet.dead:
            return
        fleet.dead.add(worker)
        self.console.log(f"[yellow]env-server replica {worker} is gone (connection closed); its "
                         f"{len(fleet.in_flight[worker])} groups in flight go to the other replicas")
        self.redispatch(fleet, worker)

    def redispatch(self, fleet: Fleet, worker: int) -> None:
        """A worker died: send its in-flight groups to the others as new attempts (fresh branch ids: the dead
        attempt's chunks are swept, exactly once, at the end)."""
        requests, fleet.in_flight[worker] = list(fleet.in_flight[worker].values()), {}
        for request in requests:
            self.resend(fleet, request, f"env-server replica {worker} died")

    def resend(self, fleet: Fleet, request: GroupRequest, why: str) -> None:
        """Send ``request`` again as its next attempt, at most ``MAX_GROUP_ATTEMPTS`` in all.

        Raises:
            RunError: the group failed ``MAX_GROUP_ATTEMPTS`` times.
        """
        if request.attempt + 1 >= MAX_GROUP_ATTEMPTS:
            raise RunError(f"group {request.group_id} failed {MAX_GROUP_ATTEMPTS} times; last: {why}")
        self.send(fleet, replace(request, attempt=request.attempt + 1))

    def collect(self, fleet: Fleet, timeout_s: float) -> None:
        """Submit every group result that arrived to the orchestrator; note replicas that went away."""
        results, ended = fleet.receive(timeout_s)
        for result in results:
            self.take(fleet, result)
        for worker in ended:
            self.lost(fleet, worker)

    def take(self, fleet: Fleet, result: GroupResult) -> None:
        """Count one replica's answer, re-send a failed group, submit its episodes."""
        request = fleet.in_flight[result.worker].pop(result.request_id, None)
        self.kept_chunks += result.kept_chunks
        self.kept_bytes += result.kept_bytes
        self.costs.process_rss(f"env_worker_{result.worker}", result.peak_rss_bytes)
        self.deletes["env worker discard"] += result.discarded
        if result.failed and request is not None and not fleet.stopping:
            self.console.log(f"[yellow]group {request.group_id} attempt {request.attempt} failed on env worker "
                             f"{result.worker} ({result.failed}); sending it again")
            self.resend(fleet, request, result.failed)
        for episode in result.episodes:
            self.running_orchestrator.submit(episode)

    def build_step(self) -> bool:
        """Publish the next step once enough groups are ready and the trainer is close enough (it published
        weights version ``s`` before the metrics of step ``s - 1``, so ``self.trained`` is a safe lower bound)."""
        cfg = self.cfg
        if self.next_step >= cfg.job.num_steps or self.trained < self.next_step - cfg.orchestrator.max_async_level:
            return False
        self.running_orchestrator.void_stale(self.next_step)
        if self.running_orchestrator.ready_groups < cfg.orchestrator.groups_per_step:
            return False
        try:
            header = self.running_orchestrator.build_step(self.next_step)
        except TransientStorageError as e:  # its groups stay queued: built again (the same bytes) next round
            self.console.log(f"[yellow]step {self.next_step}: publishing failed ({e}); trying again")
            return False
        if header is None:
            return False
        nbytes = self.store.list_sizes(STEPS_PREFIX)[step_key(self.next_step)]
        self.rows[self.next_step] = StepRow.from_header(header, nbytes, self.kept_chunks, self.kept_bytes)
        self.shipped_nbytes[self.next_step] = sum(ref.nbytes for ref in header.refs)
        self.rewards.append(header.metrics["reward_mean"])
        self.next_step += 1
        return True

    def poll_trainer(self) -> bool:
        """Show the trainer's metrics of every step it finished since the last look."""
        progressed = False
        while self.trained < self.next_step:
            try:
                metrics = json.loads(self.store.get(metrics_key(self.trained)))
            except KeyNotFoundError:
                return progressed
            if self.trained in self.stale_lives and metrics.get("life") == self.stale_lives[self.trained]:
                return progressed  # an earlier life's metrics: this life has not trained the step yet
            if self.plan and (self.trained in self.plan.skipped or self.plan.replays(self.trained)):
                self.lives["skipped" if self.trained in self.plan.skipped else "replayed"] += 1
            self.deletes["trainer"] += metrics["deletes"]
            self.alignment_max = max(self.alignment_max, metrics["on_policy_max_abs_diff"])
            self.alignment_tokens += metrics["on_policy_tokens"]
            deletes = (sum(self.running_orchestrator.deleted.values()), self.deletes["trainer"],
                       self.deletes["env worker discard"])
            row = self.rows.pop(self.trained)
            self.view.step_done(row.with_trainer(metrics, deletes))
            self.record_cost(self.trained, row.reward, metrics, deletes)
            self.trained, progressed = self.trained + 1, True
        return progressed

    def record_cost(self, step: int, reward: float, metrics: dict, deletes: tuple[int, int, int]) -> None:
        """One ``StepCost``: step ``s``'s metrics count the release of step ``s - 1`` (run in the background), which
        with ``release = "after_checkpoint"`` is the release of every step a checkpoint of step ``s - 1`` covers;
        until then a trained step's chunks are held for a checkpoint."""
        after_checkpoint = self.cfg.trainer.release == "after_checkpoint"
        if not after_checkpoint or checkpoint_due(self.cfg, step - 1):
            for released in [s for s in self.shipped_nbytes if s < step]:
                self.released_nbytes += self.shipped_nbytes.pop(released)
        in_flight = self.kept_bytes - self.running_orchestrator.deleted_nbytes - self.released_nbytes
        held = sum(n for s, n in self.shipped_nbytes.items() if s <= step) if after_checkpoint else 0
        self.costs.steps.append(StepCost(
            step=step, reward=reward, exposed_data_seconds=metrics["exposed_data_seconds_max"],
            fetch_seconds=metrics["fetch_seconds_max"], step_wait_seconds=metrics["step_wait_seconds_max"],
            kept_bytes_in_flight=in_flight, held_for_checkpoint_bytes=held,
            deletes=dict(zip(("orchestrator", "trainer", "env worker discard"), deletes))))

    def finish(self, fleet: Fleet, *, failure: str | None) -> int:
        """Audit the run, sweep what dead workers and failed deletes left (audited again), remove the empty
        directories the finished run leaves (local backend: the payload shards), print the summary; return the
        exit code: 0 audit clean and alignment within tolerance, 128 + the signal's number after SIGINT/SIGTERM
        (130, 143), else 1.

        A failed run is audited as stopped, not finished: untrained step files keep their chunks
        for a restart, and ``refpipe sweep`` is left to the user.
        """
        self.poll_trainer()  # steps the trainer finished while the fleet was stopping
        self.trainer_finished()
        failed = failure is not None
        report: AuditReport = audit(self.store, stopped=True, finished=not failed)
        # what dead workers left, deletes that failed; never on a ledger with unreadable records (the sweep refuses)
        if (fleet.dead or report.unfinished_deletes) and not (failed or report.bad_records):
            swept = sweep(self.store)  # dead sessions judged by heartbeats: safe while remote roles are closing
            self.deletes["sweep"] += len(swept.deleted)
            self.deletes["sweep: unfinished deletes finished"] += len(swept.finished_deletes)
            report = audit(self.store, stopped=True, finished=True)
        self.deletes = with_unreported(self.deletes, report.deleted)
        removed_directories = 0 if failed else self.store.remove_empty_directories()  # every role has finished
        alignment_ok = self.alignment_max < self.cfg.job.alignment_tolerance
        resumed = None if self.life is None else {
            "life": self.life.life, "from_checkpoint_step": self.life.checkpoint_step,
            "replayed_steps": self.lives["replayed"], "skipped_steps": self.lives["skipped"],
            "reclaimed_chunks": self.lives["reclaimed"]}
        self.view.summary(report, self.deletes, self.alignment_max, alignment_ok, dead_workers=sorted(fleet.dead),
                          failure=failure, resumed=resumed, release=(self.cfg.trainer.release,
                                                                     self.costs.peak_held_for_checkpoint_bytes()))
        summary = {"resumed": resumed, "failed": failed, "failure": failure, "trained_steps": self.trained,
                   "rewards": self.rewards,
                   "deletes": dict(self.deletes), "retained_chunks": report.retained,
                   "alignment_max_abs_diff": self.alignment_max,
                   "alignment_on_policy_tokens": self.alignment_tokens,
                   "alignment_ok": alignment_ok, "dead_env_workers": sorted(fleet.dead), "audit": report.model_dump(),
                   "removed_empty_directories": removed_directories,
                   **self.costs.summary()}
        self.store.put(SUMMARY_KEY, json.dumps(summary, indent=2).encode())
        self.store.put(REPORT_KEY, self.costs.plot(f"run {self.store.prefix.uri}"))
        self.console.print(f"wrote {markup_safe(self.store.uri(SUMMARY_KEY))} and "
                           f"{markup_safe(self.store.uri(REPORT_KEY))}", soft_wrap=True, highlight=False)
        if self.signals:
            return 128 + self.signals[0]
        return 0 if report.clean and alignment_ok and not failed else 1


    def _wait_for_trainer_finish(self, fleet: Fleet) -> str | None:
        """Roles started elsewhere: wait (up to ``job.step_deadline_s``) until rank 0 wrote the trainer's
        finish metrics, i.e. every rank finished its last release, before the final sweep and audit; return
        why the run failed meanwhile (a trainer rank died), else None."""
        deadline = time.monotonic() + self.cfg.job.step_deadline_s
        while not self.store.exists(FINISH_METRICS_KEY) and time.monotonic() < deadline:
            try:
                self.check_trainers(fleet)
            except RunError as e:
                self.console.log(f"[red]run stopped: {e}")
                return f"RunError: {e}"
            time.sleep(0.5)
        return None

    def check_trainers(self, fleet: Fleet) -> None:
        """Raise if a trainer rank is known dead (``Fleet.dead_trainers``), naming it and what to do next."""
        dead = fleet.dead_trainers()
        if dead:
            raise RunError(f"trainer dead: {'; '.join(dead)}. The run cannot go on: stop its other roles (env-server "
                           f"replicas, trainer ranks), then continue it from its newest checkpoint with "
                           f"`refpipe run --resume {self.store.prefix.uri}` (unless a trainer rank's own error "
                           f"says a resume meets it again)")

    def trainer_finished(self) -> None:
        """Count the trainer's last release and its ranks' peak RSS (nothing if it did not finish)."""
        try:
            finished = json.loads(self.store.get(FINISH_METRICS_KEY))
        except KeyNotFoundError:
            return
        self.deletes["trainer"] += finished["deletes"]
        for rank, nbytes in enumerate(finished["peak_rss_bytes"]):
            self.costs.process_rss(f"trainer_rank_{rank}", nbytes)


UNREPORTED_DELETES = "unreported (earlier lives, stopped processes)"
"""The path of the deletes no process of this life reported: an earlier life's, and the last releases of trainer
ranks stopped before their next metrics (step ``s``'s metrics count the release of step ``s - 2``)."""
DOUBLE_COUNTED_DELETES = "counted twice above"
"""The path of a negative rest: a path counted a delete another finished too (the orchestrator counts a failed
delete, which the final sweep finishes)."""


def with_unreported(deletes: Counter[str], deleted: int) -> Counter[str]:
    """Chunks deleted per path plus the difference from the run's total, so the paths sum to ``deleted``.

    Args:
        deletes: path (``trainer``, ``orchestrator <reason>``, ``env worker discard``, ``sweep``, ...) -> chunks
            this life's processes reported deleting.
        deleted: the run's delete records (``AuditReport.deleted``: every life, every holder).

    Returns:
        ``deletes`` with ``UNREPORTED_DELETES`` (``deleted`` exceeds the reported sum) or ``DOUBLE_COUNTED_DELETES``
        (negative: the reported sum exceeds ``deleted``) added; unchanged when they agree.
    """
    rest = deleted - sum(deletes.values())
    paths = Counter(deletes)
    if rest:
        paths[UNREPORTED_DELETES if rest > 0 else DOUBLE_COUNTED_DELETES] = rest
    return paths


@contextlib.contextmanager
def _signals_as_interrupt(received: list[int]):
    """In the main thread, let SIGINT (Ctrl-C) and SIGTERM alike stop the run with ``KeyboardInterrupt`` (so the
    fleet is stopped and audited), appending the signal's number to ``received``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
