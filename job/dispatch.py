"""Group dispatch over the env-server fleet: which replica samples which group, and what a lost one costs.

The orchestrator role (``job.launcher``) asks for as many groups as the steps that can still train them
need (``Dispatcher.dispatch``); each goes to the live replica with the fewest groups in flight. A group
whose keep failed on its replica, or whose replica died (its connection ended while the run goes on),
is sent again as its next attempt, with a fresh branch id (the dead attempt's chunks are swept, exactly
once, at the end), at most ``MAX_GROUP_ATTEMPTS`` times in all. The connections themselves are
``job.fleet``'s.
"""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from refpipe.job.config import RunConfig
from refpipe.job.env_worker import GroupRequest, GroupResult
from refpipe.job.fleet import Fleet
from refpipe.job.report import RunTally
from refpipe.pipeline.orchestrator import Orchestrator
from refpipe.storage.errors import RunError

MAX_GROUP_ATTEMPTS = 3
"""Sends of one group (the first and its re-sends after a failed keep or a dead worker) before the run fails."""


class Dispatcher:
    """Sends group requests to the fleet's replicas and submits their episodes to the orchestrator.

    Called by the orchestrator role's main thread only, once per loop round: ``dispatch`` then ``collect``
    (and ``collect`` alone while the fleet stops, ``job.fleet.stop_fleet``). Counts what the replicas
    report (chunks and bytes kept, discards, peak RSS) into ``tally``.
    """

    def __init__(self, cfg: RunConfig, fleet: Fleet, orchestrator: Orchestrator, console: Console, tally: RunTally,
                 *, branch_prefix: str = ""):
        """``branch_prefix``: put before every group id (a later life's ``l<life>-``: it never reuses a branch id)."""
        self.cfg, self.fleet, self.orchestrator, self.console, self.tally = cfg, fleet, orchestrator, console, tally
        self.branch_prefix = branch_prefix
        self.next_request = 0

    def dispatch(self, trained: int, next_step: int) -> None:
        """Request groups from the live workers with the fewest in flight, as many as the steps that can
        still train them need: a group sampled now has policy version >= ``trained`` (steps the trainer
        finished), so it serves steps up to ``trained + max_async_level``; more would only go stale.
        ``next_step``: the next step to build.

        Raises:
            RunError: every replica died, or a group failed ``MAX_GROUP_ATTEMPTS`` times.
        """
        orch = self.cfg.orchestrator
        last_step = min(trained + orch.max_async_level, self.cfg.job.num_steps - 1)
        limit = (last_step - next_step + 1) * orch.groups_per_step
        while sum(len(f) for f in self.fleet.in_flight) + self.orchestrator.ready_groups < limit:
            every = self.cfg.job.eval_every_steps
            is_eval = bool(every) and self.next_request % (every * orch.groups_per_step) == 1
            self.send(GroupRequest(self.next_request, f"{self.branch_prefix}g{self.next_request:06d}",
                                   self.next_request, is_eval))
            self.next_request += 1

    def send(self, request: GroupRequest) -> None:
        """Send to the live replica with the fewest groups in flight (a replica whose connection is gone
        is declared dead and the next one tried).

        Raises:
            RunError: every replica died, or a group of a dead replica failed ``MAX_GROUP_ATTEMPTS`` times.
        """
        fleet = self.fleet
        while True:
            live = [w for w in fleet.live() if w not in fleet.dead]
            if not live:
                raise RunError("every env-server replica died; see the log above")
            worker = min(live, key=lambda w: len(fleet.in_flight[w]))
            if fleet.send(worker, request):
                fleet.in_flight[worker][request.request_id] = request
                return
            fleet.close(worker)  # never reached: the next live replica gets it below, not a re-dispatch too
            self.lost(worker)

    def collect(self, timeout_s: float) -> None:
        """Submit every group result that arrived within ``timeout_s`` to the orchestrator; note replicas that
        went away (their groups go to the others)."""
        results, ended = self.fleet.receive(timeout_s)
        for result in results:
            self.take(result)
        for worker in ended:
            self.lost(worker)

    def lost(self, worker: int) -> None:
        """A replica's connection ended: while running, it died (its groups go to the others)."""
        fleet = self.fleet
        if fleet.stopping or worker in fleet.dead:
            return
        fleet.dead.add(worker)
        self.console.log(f"[yellow]env-server replica {worker} is gone (connection closed); its "
                         f"{len(fleet.in_flight[worker])} groups in flight go to the other replicas")
        requests, fleet.in_flight[worker] = list(fleet.in_flight[worker].values()), {}
        for request in requests:
            self.resend(request, f"env-server replica {worker} died")

    def resend(self, request: GroupRequest, why: str) -> None:
        """Send ``request`` again as its next attempt, at most ``MAX_GROUP_ATTEMPTS`` in all.

        Raises:
            RunError: the group failed ``MAX_GROUP_ATTEMPTS`` times.
        """
        if request.attempt + 1 >= MAX_GROUP_ATTEMPTS:
            raise RunError(f"group {request.group_id} failed {MAX_GROUP_ATTEMPTS} times; last: {why}")
        self.send(replace(request, attempt=request.attempt + 1))

    def take(self, result: GroupResult) -> None:
        """Count one replica's answer, re-send a failed group, submit its episodes."""
        request = self.fleet.in_flight[result.worker].pop(result.request_id, None)
        tally = self.tally
        tally.kept_chunks += result.kept_chunks
        tally.kept_bytes += result.kept_bytes
        tally.costs.process_rss(f"env_worker_{result.worker}", result.peak_rss_bytes)
        tally.deletes["env worker discard"] += result.discarded
        if result.failed and request is not None and not self.fleet.stopping:
            self.console.log(f"[yellow]group {request.group_id} attempt {request.attempt} failed on env worker "
                             f"{result.worker} ({result.failed}); sending it again")
            self.resend(request, result.failed)
        for episode in result.episodes:
            self.orchestrator.submit(episode)
