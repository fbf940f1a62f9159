"""The orchestrator role (``refpipe orchestrate``) and ``refpipe run``, its one-machine composition.

``Launcher.orchestrate`` is the orchestrator of a run that ``refpipe init`` prepared: it
connects to the ``job.num_env_workers`` env-server replicas (``job.fleet``), then loops over
named steps until every step was trained:

    check the trainer -> dispatch group requests -> collect episodes -> build a step -> show progress

(dispatch and collection: ``job.dispatch``; the trainer's side: ``job.trainer_progress``). Then it
stops the replicas, shuts the orchestrator down and ends the run (``job.run_end``: the sweep of what
dead replicas left behind, the ledger audit, ``summary.json``). The exit code is non-zero when the
audit or the alignment check fails.

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

import torch
from rich.console import Console

from refpipe.job.config import RunConfig
from refpipe.job.dispatch import Dispatcher
from refpipe.job.fleet import Fleet, connect_fleet, stop_fleet
from refpipe.job.progress import ProgressView, StepRow
from refpipe.job.report import RunTally
from refpipe.job.resume import LifeStart
from refpipe.job.roles import start_local_roles, write_run_config
from refpipe.job.run_end import RunEnd, finish_run
from refpipe.job.text import markup_safe
from refpipe.job.trainer_progress import TrainerProgress
from refpipe.job.weights import point_latest, publish_weights
from refpipe.job.workload.model import MoELM
from refpipe.job.workload.task import warm_start
from refpipe.pipeline.orchestrator import Orchestrator
from refpipe.pipeline.step_file import StepFile
from refpipe.pipeline.sweep import sweep
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
from refpipe.storage.layout import CONFIG_KEY, STEPS_PREFIX, metrics_key, step_key
from refpipe.storage.store import Store
from refpipe.trainer.resume import read_plan


class Launcher:
    """Drives one run; see the module docstring for the order of things. Runs in one process, on its main thread
    (signals are handled there)."""

    def __init__(self, cfg: RunConfig, console: Console, *, resume: bool = False):
        self.cfg, self.console, self.resume = cfg, console, resume
        self.store: Store = open_store(cfg.storage)
        self.view = ProgressView(console, cfg)
        self.tally = RunTally()
        self.trainer = TrainerProgress(cfg, self.store, console, self.view, self.tally)
        self.orchestrator: Orchestrator | None = None
        self.next_step = 0
        self.signals: list[int] = []
        """SIGINT (Ctrl-C) and SIGTERM received by ``run``/``orchestrate`` in the main thread: the first sets the
        exit code, 128 + its number (the shell's convention)."""
        self.life: LifeStart | None = None

    def run(self) -> int:
        """``refpipe run``: initialise the run, start the replicas and trainer ranks here, orchestrate;
        return the process exit code (0: audit clean and alignment within tolerance)."""
        with _signals_as_interrupt(self.signals):  # SIGTERM before the fleet exists ends like Ctrl-C
            if self.resume:
                self.prepare_resume()
            else:
                self.prepare()
            plan = self.trainer.plan
            env_procs, trainers = start_local_roles(self.cfg, self.store.prefix.uri, _free_port(),
                                                    published=plan.published if plan else None)
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
            dispatcher = Dispatcher(self.cfg, fleet, self.orchestrator, self.console, self.tally,
                                    branch_prefix=f"l{self.life.life}-" if self.life else "")
            failure = self.drive(fleet, dispatcher)
        if not trainers and failure is None:
            failure = self.trainer.wait_for_finish(fleet)
        self.trainer.poll(self.orchestrator)  # steps the trainer finished while the fleet was stopping
        self.trainer.finished()
        return finish_run(self.cfg, self.store, self.console, self.view, self.tally,
                          RunEnd(trained=self.trainer.trained, dead_workers=sorted(fleet.dead), failure=failure,
                                 signals=self.signals, life=self.life))

    @property
    def running_orchestrator(self) -> Orchestrator:
        """The orchestrator ``orchestrate`` made; everything after that reads it here."""
        assert self.orchestrator is not None, "orchestrate() makes the orchestrator first"
        return self.orchestrator

    def drive(self, fleet: Fleet, dispatcher: Dispatcher) -> str | None:
        """Loop until done, then stop the fleet and shut the orchestrator down; return why the run failed."""
        failure = None
        try:
            self.loop(fleet, dispatcher)
        except RefpipeError as e:
            failure = f"{type(e).__name__}: {e}"
        except KeyboardInterrupt:
            failure = f"interrupted ({signal.Signals(self.signals[0]).name})" if self.signals else "interrupted"
        finally:
            if failure:
                self.console.log(f"[red]run stopped: {failure}")
            stop_fleet(fleet, dispatcher.collect, failed=failure is not None)
            self.running_orchestrator.shutdown()
            self.tally.deletes.update({f"orchestrator {k}": v for k, v in self.running_orchestrator.deleted.items()})
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
        life, lives = LifeStart.read(self.store, self.cfg.job.num_steps), self.tally.lives
        try:
            swept = sweep(self.store, stopped=True)
            lives["reclaimed"] = len(swept.deleted) + len(swept.removed_incomplete) + len(swept.finished_deletes)
            self.tally.deletes["sweep at resume"] += len(swept.deleted)
        except RunStillRunningError as e:
            raise ConfigError(f"refusing to resume {self.store.prefix.uri}: another life of the run is still running: "
                              f"{', '.join(e.running)} (heartbeats live); stop it (on every node) first") from e
        except LedgerRecordError as e:  # the run goes on; its audit reports the record, nothing is reclaimed
            self.console.log(f"[yellow]not reclaiming what dead sessions kept:[/] {markup_safe(str(e))}")
        trainer = self.trainer
        trainer.plan = read_plan(self.store, self.cfg.orchestrator.dp_world_size, life.published)  # after the sweep
        point_latest(self.store, life.policy_version)
        self.store.put(CONFIG_KEY, self.cfg.model_dump_json(indent=2).encode())
        self.life, trainer.trained, self.next_step = life, life.checkpoint_step + 1, life.published
        sizes = self.store.list_sizes(STEPS_PREFIX)
        for step in range(trainer.trained, life.published):
            trainer.rows[step] = StepRow.from_header(StepFile.read(self.store, step).header, sizes[step_key(step)],
                                                     0, 0)
            with contextlib.suppress(KeyNotFoundError):
                trainer.stale_lives[step] = json.loads(self.store.get(metrics_key(step))).get("life")
        self.console.log(f"resuming run {self.store.prefix.uri} (life {life.life}) {trainer.plan.describe()}; steps "
                         + "; ".join(f"{k} {len(v)}" for k, v in life.classes.items())
                         + f"; {lives['reclaimed']} chunks reclaimed from dead sessions", highlight=False)

    def loop(self, fleet: Fleet, dispatcher: Dispatcher) -> None:
        """Until every step is trained: check, dispatch, collect, build, show.

        Raises:
            RunError: a trainer rank died, every replica died, a group failed on every attempt, or nothing
                progressed for ``job.step_deadline_s``.
        """
        deadline = time.monotonic() + self.cfg.job.step_deadline_s
        with self.view:
            while self.trainer.trained < self.cfg.job.num_steps:
                self.trainer.check(fleet)
                dispatcher.dispatch(self.trainer.trained, self.next_step)
                dispatcher.collect(timeout_s=0.1)
                progressed = self.build_step() | self.trainer.poll(self.running_orchestrator)
                if progressed:
                    deadline = time.monotonic() + self.cfg.job.step_deadline_s
                elif time.monotonic() > deadline:
                    raise RunError(f"no progress for {self.cfg.job.step_deadline_s:.0f} s at step {self.next_step} "
                                   f"(trained {self.trainer.trained}, ready groups "
                                   f"{self.running_orchestrator.ready_groups})")

    def build_step(self) -> bool:
        """Publish the next step once enough groups are ready and the trainer is close enough (it published
        weights version ``s`` before the metrics of step ``s - 1``, so ``trainer.trained`` is a safe lower bound)."""
        cfg, orchestrator = self.cfg, self.running_orchestrator
        too_far = self.trainer.trained < self.next_step - cfg.orchestrator.max_async_level
        if self.next_step >= cfg.job.num_steps or too_far:
            return False
        orchestrator.void_stale(self.next_step)
        if orchestrator.ready_groups < cfg.orchestrator.groups_per_step:
            return False
        try:
            header = orchestrator.build_step(self.next_step)
        except TransientStorageError as e:  # its groups stay queued: built again (the same bytes) next round
            self.console.log(f"[yellow]step {self.next_step}: publishing failed ({e}); trying again")
            return False
        if header is None:
            return False
        nbytes = self.store.list_sizes(STEPS_PREFIX)[step_key(self.next_step)]
        row = StepRow.from_header(header, nbytes, self.tally.kept_chunks, self.tally.kept_bytes)
        self.trainer.built(row, sum(ref.nbytes for ref in header.refs))
        self.tally.rewards.append(header.metrics["reward_mean"])
        self.next_step += 1
        return True


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
