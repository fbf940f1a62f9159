"""Audit and sweep of a run's chunks: the proof of invariants 1-3 (DESIGN.md).

The audit merges four sources under the run prefix, read-only (``pipeline.audit_scan``):

- the listing of ``payloads/``: present chunks; a chunk node with ``zarr.json`` is
  committed, one without is an incomplete keep (its writer died mid-keep, or is mid-keep); one with ``zarr.json``
  but no ``c.0`` and no delete record lost its rows outside the ledger (missing);
- the listing of ``ledger/deletes/``: delete records (tombstones), and release records (each read: every
  chunk it lists is deleted; a chunk two records claim is a double delete);
- the step files (``steps/``): what was shipped, to which DP rank owner, borrowed or not;
- the event segments (``ledger/events/``): sessions (``open``/``close``), ``keep`` and
  ``receive`` events, trainer ``trained``/``release``/``retain`` events, double and unknown deletes.

Who accounts for a present chunk (its holder), in this order:

1. a delete record exists: nobody; the deleter died between claim and delete
   (``unfinished_deletes``; the sweep removes the leftovers), unless a live session's delete batch
   claimed it: that actor (``<actor> (deleted, bytes being removed)``: its ledger's reaper removes
   them). No delete record, but an
   ``unfinished_delete`` event (a holder decided to delete it and its claim put failed, so
   the claim was never written): that holder while its session is live
   (``<actor> (unfinished delete)``: it retries with its own claim), else nobody
   (``unfinished_deletes``; the sweep claims and deletes it). Either way no step file
   protects it any more: its last holder was done with it;
2. a step file ``N`` references it and some DP rank owning one of its refs has not released
   step ``N`` (nor a later one: trainer ranks go through steps in order), whatever the sessions'
   state: ``trainer_dp<r> (trained, awaiting checkpoint)`` while its owner ``r`` recorded
   ``trained`` but not ``release`` for step ``N`` or later (``release = "after_checkpoint"``),
   else ``trainer step N`` (a step is protected whole: a replaying rank may borrow rows);
   and, whatever the ledger events say, a step a resume replays (``trainer.resume``: the run's
   ``config.json`` says ``release = "after_checkpoint"``, the step is after the newest complete
   checkpoint and none of its chunks has a delete record): ``trainer step N (after the newest
   checkpoint: ...)``, even over an ``unfinished_delete`` event; not for a finished or abandoned run;
   and a segment of an open branch suspended at a step boundary (``storage.ledger_open``: its record exists):
   ``open branch <id> (suspended)``, not for a finished or abandoned run (the sweep then discards it whole);
3. a shared prefix (``storage.ledger_holds``) some of whose declared holders were not released, while any
   session is live: ``shared prefix (<k> of <m> holders released)``;
4. a shipped chunk its owner released: ``retained`` if a ``retain`` event names it (kept for
   inspection; not outstanding, and not a violation of a finished run), else nobody; with or without its
   ``zarr.json`` (a step file names it, so its keep committed once: a missing marker is damage, which
   ``refpipe verify`` names, never an incomplete keep the sweep would remove);
5. an unshipped incomplete keep: its writer's live session, else (writer unknown) any live session;
6. an unshipped chunk: the live ``orchestrator`` session if a ``receive`` event names it;
   else its keeping session while live (the ``keep`` event's session; without one, the
   writer's latest session); else a live ``orchestrator`` session, which may still hold
   it in its queue (a restarted env server loses nothing).

A session is live while its heartbeat changes (``storage.liveness``: judged by the
auditor's clock, so it works for sessions on any host; an audit of a run with a stale
session waits up to that session's heartbeat timeout, 15 s by default); a closed session
is dead at once. ``stopped=True`` declares that no process
of the run is running: every session is dead, but untrained step files still hold their
chunks for a restarted trainer. ``finished=True`` (implies stopped) declares the run
over: anything still outstanding is then a violation.

Leaked: present, no delete record, no holder. The sweep (``pipeline.sweep``) deletes exactly those,
finishes unfinished deletes, and never touches a chunk of an untrained or replayed step file. A ledger
record that cannot be read (``bad_records``: not JSON, a crc32c mismatch, ...) is a violation, and the
sweep then deletes nothing (``LedgerRecordError``): the record may have named a holder.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, computed_field
from rich.progress import Progress

from refpipe.pipeline.audit_scan import RunScan, StaleSummaryError, committed, scan_run
from refpipe.pipeline.audit_summary import load_summary, seed_scan, settle, write_summary
from refpipe.storage.checkpoints import newest_checkpoint
from refpipe.storage.errors import KeyNotFoundError, RunStillRunningError
from refpipe.storage.layout import CONFIG_KEY, DATA_NAME, ORCHESTRATOR_ACTOR
from refpipe.storage.liveness import live_sessions
from refpipe.storage.store import Store

RETAINED = "retained"
AWAITING_CHECKPOINT = "trained, awaiting checkpoint"
REPLAY = "after the newest checkpoint: a resume replays it"
UNFINISHED = "unfinished delete"
FREEING = "deleted, bytes being removed"
SUSPENDED = "suspended"


class AuditReport(BaseModel):
    """What the audit found. Chunks are named by node URI (``<run>/payloads/<shard>/<branch_id>``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_uri: str
    stopped: bool
    """No process of the run was declared running (every session dead)."""
    finished: bool
    """The run was declared over (outstanding chunks are violations)."""
    kept: int
    """Committed chunks ever: present with ``zarr.json`` plus delete records."""
    shipped: int
    """Distinct chunks referenced by step files."""
    borrowed: int
    """Distinct chunks whose rows a padding dummy borrows (also counted in ``shipped``)."""
    deleted: int
    """Delete records (each chunk at most one); listed, not read (``pipeline.audit_scan``)."""
    present: int
    """Chunk nodes under ``payloads/`` (committed or not), but those whose data is gone (``missing``)."""
    outstanding: int
    """Present chunks a live holder accounts for (retained chunks are not outstanding)."""
    outstanding_by_holder: dict[str, int]
    """Holder (``trainer step N``, ``trainer_dp<r> (trained, awaiting checkpoint)``, an actor name,
    ``orchestrator``, ``incomplete keep``) -> chunks."""
    retained: int = 0
    """Present chunks handed to the ``retained`` holder (``trainer.retain_steps``); a finished run has
    ``kept == deleted + retained``."""
    retained_chunks: list[str] = []
    """The retained chunks (what ``sweep(retained=True)`` deletes)."""
    leaked: int
    leaked_chunks: list[str]
    """Present chunks without a delete record that no live holder accounts for."""
    incomplete_keeps: list[str]
    """Chunk nodes without ``zarr.json`` (held while their writer may be mid-keep, else leaked)."""
    unfinished_deletes: list[str]
    """Present chunks whose delete did not finish: a delete record exists (the deleter died mid-delete), or a
    dead session recorded an ``unfinished_delete`` for it (its claim was never written)."""
    double_deletes: int
    unknown_deletes: int
    delete_problems: list[str]
    """One line per ``double_delete``/``unknown_delete`` event."""
    missing: list[str]
    """Chunks a keep event or an untrained step file names, neither present nor deleted by the ledger; and committed
    chunks whose data (``c.0``) is gone without a delete record (their rows are lost)."""
    unreadable_step_files: list[str]
    bad_records: list[str]
    """``<segment URI> line <n>: <error>`` of every ledger record that cannot be read: not JSON, no event name,
    a crc32c mismatch (changed after it was written), no line end, a field of the wrong type. A violation: the
    record may be the only evidence of a holder, so the sweep refuses to delete."""
    stray_keys: list[str]
    """Keys where no refpipe object belongs (temp files of killed writers)."""
    live_sessions: list[str]
    """``<actor>/<session>`` of every live session."""
    violations: list[str]
    """Broken invariants, one line each; empty when the run is clean."""

    @computed_field  # type: ignore[prop-decorator]  # pydantic documents this form; mypy cannot type it
    @property
    def clean(self) -> bool:
        """No invariant is violated."""
        return not self.violations


def live_sessions_of(store: Store, scan: RunScan) -> set[tuple[str, str]]:
    """The unclosed sessions whose heartbeat is live (may wait, see ``storage.liveness.live_sessions``)."""
    unclosed = [(actor, s) for actor, sessions in scan.sessions.items() for s in sessions
                if (actor, s) not in scan.closed]
    return live_sessions(store, unclosed)


def refuse_if_running(store: Store, live: set[tuple[str, str]], scan: RunScan, verb: str = "sweep",
                       instead: str = "") -> None:
    """Raise ``RunStillRunningError`` when a session of the run is live (its heartbeat changes), on any host;
    the message says what would be refused (``verb``) and what to do ``instead`` (default: stop the run, or
    ``--force``)."""
    host = socket.gethostname()
    running = []
    for actor, session in sorted(live):
        pid, opened_on = scan.opens.get((actor, session), ("?", "?"))
        running.append(f"{actor} (pid {pid} on {'this host' if opened_on == host else opened_on})")
    if running:
        one = len(running) == 1
        them = "that process is" if one else "those processes are"
        instead = instead or f"stop the run first, or pass --force if {them} not part of the run"
        raise RunStillRunningError(
            f"refusing to {verb} {store.prefix.uri} as stopped: {', '.join(running)} {'is' if one else 'are'} still "
            f"running (heartbeat live); {instead}", running=running)


def step_nodes(scan: RunScan) -> tuple[dict[str, int], dict[str, str], set[str]]:
    """``(shipped, protected, borrowed)``: node -> step for every shipped chunk, node -> holder for chunks
    their owner DP rank has not released yet (module doc, rule 2), and the borrowed nodes."""
    shipped: dict[str, int] = {}
    protected: dict[str, str] = {}
    borrowed: set[str] = set()
    for step, header in sorted(scan.steps.items()):
        released = all(scan.released.get(owner, -1) >= step for owner in set(header.owners))
        for node, owner in ((n, o) for ref, o in zip(header.refs, header.owners) for n in ref.nodes):
            shipped.setdefault(node, step)
            if released or node in protected:
                continue
            held = scan.trained.get(owner, -1) >= step > scan.released.get(owner, -1)
            protected[node] = f"trainer_dp{owner} ({AWAITING_CHECKPOINT})" if held else f"trainer step {step}"
        borrowed |= {n for mb in header.micro_batches for s in mb.sequences
                     if s.borrowed and s.ref is not None  # (StepHeader: a borrowed sequence has a ref)
                     for n in header.refs[s.ref].nodes}
    return shipped, protected, borrowed


def _replays_after_checkpoint(store: Store, scan: RunScan) -> bool:
    """Whether a resume of the run replays the steps after its newest checkpoint from their chunks: its
    ``config.json`` says ``trainer.release = "after_checkpoint"``; without a readable ``config.json`` (a run
    driven through the library), whether a DP rank recorded ``trained`` (only that policy does)."""
    try:
        return bool(json.loads(store.get(CONFIG_KEY))["trainer"]["release"] == "after_checkpoint")
    except (KeyNotFoundError, ValueError, KeyError, TypeError):
        return bool(scan.trained)


def _replayed(store: Store, scan: RunScan, protected: dict[str, str]) -> dict[str, str]:
    """Node -> holder for the chunks of every step a resume trains again (``trainer.resume``) in a run that
    replays (``_replays_after_checkpoint``): a step after the newest complete checkpoint
    (``storage.checkpoints.newest_checkpoint``; none: every step) none of whose chunks has a delete record.
    Judged from step files, checkpoints, delete records and ``config.json``, never from ledger events (but for a
    run without ``config.json``), so no lost, corrupted or forged ledger record exposes them to the sweep. Reads
    ``config.json`` and the checkpoints only when a step file's chunks are present and otherwise unprotected."""
    steps = {step: nodes for step, header in scan.steps.items()
             if (nodes := [n for ref in header.refs for n in ref.nodes])
             and not any(n in scan.tombstoned for n in nodes)
             and any(n in scan.nodes and n not in protected for n in nodes)}
    if not steps or not _replays_after_checkpoint(store, scan):
        return {}
    checkpoint = newest_checkpoint(store)
    after = checkpoint.step if checkpoint else -1
    return {node: f"trainer step {step} ({REPLAY})" for step, nodes in sorted(steps.items()) if step > after
            for node in nodes if node not in protected}


def _lost_data(keys: list[str]) -> bool:
    """Whether a chunk node's keys include its commit marker but not its data (``c.0``, written before the marker and
    removed after it: removed outside the ledger)."""
    return committed(keys) and not any(k.endswith("/" + DATA_NAME) for k in keys)


def _freeing(node: str, scan: RunScan, live: set[tuple[str, str]]) -> str | None:
    """The actor of a live session whose delete batch claimed ``node`` (its ledger's reaper removes the bytes after
    the delete returned: ``storage.ledger_reaper``), or None."""
    return next((holder for holder, _, session in scan.claims.get(node, ()) if (holder, session) in live), None)


def _holder(node: str, keys: list[str], scan: RunScan, live: set[tuple[str, str]], shipped: dict[str, int],
            protected: dict[str, str]) -> str | None:
    """Who accounts for a present, undeleted chunk (module doc, rules 2-6); None: leaked."""
    live_actors = {actor for actor, _ in live}
    if node in protected:
        return protected[node]
    held, released = set(scan.holds.get(node, ())), scan.released_holds.get(node, set())
    if live and not held <= released:  # a shared prefix: its holders may still release it
        return f"shared prefix ({len(held & released)} of {len(held)} holders released)"
    keeper = scan.keeps.get(node)
    writer = keeper[0] if keeper else scan.writers.get(node, "")
    keeper_live = keeper in live if keeper else writer in live_actors
    if node in shipped:  # its keep committed once (a step file names it): no zarr.json now is damage, not a keep
        return RETAINED if node in scan.retained else None
    if not committed(keys):
        return writer if keeper_live else ("incomplete keep" if live and not writer else None)
    orchestrator_live = ORCHESTRATOR_ACTOR in live_actors
    if node in scan.received and orchestrator_live:
        return ORCHESTRATOR_ACTOR
    if keeper_live:
        return writer
    return ORCHESTRATOR_ACTOR if orchestrator_live else None


def judge(scan: RunScan, store: Store, *, stopped: bool = False, finished: bool = False,
          abandoned: bool = False, live: set[tuple[str, str]] | None = None) -> AuditReport:
    """Turn a scan into the audit report (module doc: holders, liveness, violations).

    ``abandoned`` (implies ``stopped``): the run will never be resumed, so untrained step files
    hold nothing and their chunks count as leaked. ``live``: the live sessions when already
    judged (else read from their heartbeats here, unless stopped).
    """
    stopped = stopped or finished or abandoned
    live = set() if stopped else live_sessions_of(store, scan) if live is None else live
    shipped, protected, borrowed = step_nodes(scan)
    replayed = {} if finished or abandoned else _replayed(store, scan, protected)
    protected = {} if abandoned else {**protected, **replayed}
    if not finished and not abandoned:  # a later step may continue a suspended open branch
        protected |= {n: f"open branch {b} ({SUSPENDED})" for n, b in scan.open_nodes.items() if n not in protected}
    holders: Counter[str] = Counter()
    leaked, unfinished, retained_chunks, lost = [], [], [], []
    for node, keys in sorted(scan.nodes.items()):
        claimant = scan.unfinished.get(node)
        if node not in scan.tombstoned and _lost_data(keys):  # its rows are gone: missing, whoever held it
            lost.append(node)
        elif node in scan.tombstoned:
            if freeing := _freeing(node, scan, live):  # claimed by a live deleter, its reaper removing the bytes
                holders[f"{freeing} ({FREEING})"] += 1
            else:
                unfinished.append(node)
        elif node in replayed:  # whatever a ledger record says (an unfinished_delete)
            holders[replayed[node]] += 1
        elif claimant and claimant not in live:
            unfinished.append(node)
        elif claimant:
            holders[f"{claimant[0]} ({UNFINISHED})"] += 1
        elif holder := _holder(node, keys, scan, live, shipped, protected):
            holders[holder] += 1
            if holder == RETAINED:
                retained_chunks.append(node)
        else:
            leaked.append(node)
    retained = holders.pop(RETAINED, 0)
    expected = set(scan.keeps) | set(protected)
    missing = sorted([n for n in expected if n not in scan.nodes and n not in scan.tombstoned] + lost)
    problems = scan.problems + scan.double_claims
    doubles = [p for p in problems if p.get("event") == "double_delete"]
    uri = store.uri
    settled = scan.settled
    report: dict[str, Any] = dict(
        run_uri=store.prefix.uri, stopped=stopped, finished=finished,
        kept=sum(committed(k) for n, k in scan.nodes.items() if n not in scan.tombstoned) + len(scan.tombstoned)
        + settled["kept"], shipped=len(shipped) + settled["shipped"], borrowed=len(borrowed) + settled["borrowed"],
        deleted=len(scan.tombstoned) + settled["deleted"], present=len(scan.nodes) - len(lost),
        outstanding=sum(holders.values()), outstanding_by_holder=dict(sorted(holders.items())), retained=retained,
        retained_chunks=[uri(n) for n in retained_chunks],
        leaked=len(leaked), leaked_chunks=[uri(n) for n in leaked],
        incomplete_keeps=[uri(n) for n, k in sorted(scan.nodes.items()) if not committed(k)],
        unfinished_deletes=[uri(n) for n in unfinished], double_deletes=len(doubles),
        unknown_deletes=len(problems) - len(doubles), delete_problems=[_problem_line(p) for p in problems],
        missing=[uri(n) for n in missing], unreadable_step_files=sorted(scan.unreadable_steps),
        bad_records=scan.bad_records, stray_keys=sorted(scan.stray_keys),
        live_sessions=sorted(f"{actor}/{session}" for actor, session in live),
    )
    return AuditReport(**report, violations=_violations(report))


def _problem_line(event: dict) -> str:
    first = ""
    if event.get("event") == "double_delete":
        holder, why = event.get("first"), event.get("first_reason")
        if holder in (None, "?"):
            first = f", first deleted by an unknown holder ({why or 'the double delete event does not name it'})"
        else:
            first = f", first deleted by {holder}" + (f" ({why})" if why else "")
    return f"{event.get('event')} of {event.get('uri') or event.get('branch_id')} by {event.get('actor')} " \
           f"({event.get('reason')}){first}"


def _violations(r: dict) -> list[str]:
    sweep_command = "refpipe sweep --stopped" if r["stopped"] else "refpipe sweep"
    checks = [
        (r["leaked"], f"leaked chunks (present, no live holder; `{sweep_command}` deletes them)"),
        (r["double_deletes"], "double deletes"),
        (r["unknown_deletes"], "deletes of unknown refs"),
        (len(r["unfinished_deletes"]), "unfinished deletes (objects still present; `refpipe sweep` finishes them)"),
        (len(r["missing"]), "chunks missing without a delete record"),
        (len(r["unreadable_step_files"]), "unreadable step files"),
        (len(r["bad_records"]), f"unreadable ledger records ({'; '.join(r['bad_records'][:3])}"
                                f"{'; ...' if len(r['bad_records']) > 3 else ''}); `refpipe sweep` refuses to delete "
                                f"until each is repaired or its line removed"),
        (r["outstanding"] if r["finished"] else 0, "chunks still outstanding at the declared end of the run"),
    ]
    return [f"{n} {what}" for n, what in checks if n]


def audit(store: Store, *, stopped: bool = False, finished: bool = False, incremental: bool = False,
          confirm_stopped: bool = False, progress: Progress | None = None) -> AuditReport:
    """Audit a run: kept, shipped, deleted, outstanding by holder, leaks and ledger violations.

    Read-only. Cost: one listing each of ``steps/``, ``ledger/events/``, ``ledger/deletes/``,
    ``payloads/``; one GET per step file (whole), per ledger segment and per release record (S3: one per DP
    rank and step; ``storage.ledger_release``); one GET of
    ``zarr.json`` per unshipped chunk whose writer neither a keep event nor its branch id
    names; one HEAD per chunk deleted while the audit was listing.

    Args:
        stopped: no process of the run is running (every session is dead).
        finished: the run is over (implies ``stopped``; outstanding chunks are violations).
        incremental: start from the run's audit summary (``pipeline.audit_summary``: only step files and
            segments not covered are read, delete records are checked per unsettled chunk instead of listed, and
            the release records of unsettled steps are read)
            and write the new summary: the one write of an audit. A stale or unreadable summary is ignored.
        confirm_stopped: with ``stopped`` or ``finished``, check that declaration by the sessions' heartbeats first
            (``refpipe audit --stopped``: a live run audited as stopped counted its live holders' chunks as leaked).
        progress: a rich ``Progress`` to show listing and reading progress on.

    Raises:
        RunStillRunningError: ``confirm_stopped`` and a session of the run is live by its heartbeat, on any host.
    """
    summary = load_summary(store) if incremental else None
    try:
        scan = scan_run(store, progress, seed_scan(summary) if summary else None)
    except StaleSummaryError:
        scan = scan_run(store, progress)
    if confirm_stopped and (stopped or finished):
        refuse_if_running(store, live_sessions_of(store, scan), scan, "audit",
                           "audit it without --stopped/--finished while it runs")
    report = judge(scan, store, stopped=stopped, finished=finished)
    if incremental:
        write_summary(store, settle(scan))
    return report
