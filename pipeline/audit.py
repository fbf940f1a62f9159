"""Audit and sweep of a run's chunks: the proof of invariants 1-3 (DESIGN.md).

The audit merges four sources under the run prefix, read-only:

- the listing of ``payloads/``: present chunks; a chunk node with ``zarr.json`` is
  committed, one without is an incomplete keep (its writer died mid-keep, or is mid-keep);
- the listing of ``ledger/deletes/``: delete records (tombstones);
- the step files (``steps/``): what was shipped, to which DP rank owner, borrowed or not;
- the event segments (``ledger/events/``): sessions (``open``/``close``), ``keep`` and
  ``receive`` events, trainer ``release`` events, double and unknown deletes.

Who accounts for a present chunk (its holder), in this order:

1. a delete record exists: nobody; the deleter died between claim and delete
   (``unfinished_deletes``; the sweep removes the leftovers);
2. a step file ``N`` not yet trained references it: ``trainer step N``, whatever the
   sessions' state. Step ``N`` is trained once every DP rank owning one of its refs has
   released step ``N`` or a later one (trainer ranks train steps in order, so a release
   of step ``M > N`` means rank r is done with ``N``, e.g. after resuming from a checkpoint);
3. an incomplete keep: its writer's live session, else (writer unknown) any live session;
4. a shipped chunk of a trained step: nobody (its owner released it without deleting it);
5. an unshipped chunk: the live ``orchestrator`` session if a ``receive`` event names it;
   else its keeping session while live (the ``keep`` event's session; without one, the
   writer's latest session); else a live ``orchestrator`` session, which may still hold
   it in its queue (a restarted env server loses nothing).

A session is live from its ``open`` event until its ``close`` event or until a newer
session of the same actor opens (a restart). ``stopped=True`` declares that no process
of the run is running: every session is dead, but untrained step files still hold their
chunks for a restarted trainer. ``finished=True`` (implies stopped) declares the run
over: anything still outstanding is then a violation.

Leaked: present, no delete record, no holder. The sweep deletes exactly those (claiming
each through ``Ledger.delete_nodes``), finishes unfinished deletes, and never touches a
chunk of an untrained step file.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, computed_field
from rich.progress import Progress

from pipeline.step_file import StepFile, StepHeader, step_key
from storage.chunk import META_KEY, node_key, read_attributes
from storage.errors import ChunkNotFoundError, ConfigError, DoubleDeleteError, StepFileError, UnknownRefError
from storage.ledger import DELETES_PREFIX, Ledger, parse_segment_key, session_opened_ms
from storage.store import Store

ORCHESTRATOR_ACTOR = "orchestrator"
SWEEP_ACTOR = "sweep"
SWEEP_REASON = "sweep: no live holder (left behind by a crash)"
_STEP_KEY = re.compile(r"^steps/step_(\d+)\.npz$")
_DRAWN_ID = re.compile(r"^(?P<writer>.+)-[0-9a-f]{32}$")
"""Branch ids drawn by ``Keeper.keep``: ``<actor>-<uuid4 hex>``; they name their writer."""
T = TypeVar("T")
R = TypeVar("R")


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
    """Delete records (each chunk at most one)."""
    present: int
    """Chunk nodes under ``payloads/`` (committed or not)."""
    outstanding: int
    """Present chunks a live holder accounts for."""
    outstanding_by_holder: dict[str, int]
    """Holder (``trainer step N``, an actor name, ``orchestrator``, ``incomplete keep``) -> chunks."""
    leaked: int
    leaked_chunks: list[str]
    """Present chunks without a delete record that no live holder accounts for."""
    incomplete_keeps: list[str]
    """Chunk nodes without ``zarr.json`` (held while their writer may be mid-keep, else leaked)."""
    unfinished_deletes: list[str]
    """Chunks with a delete record whose objects are still present (the deleter died mid-delete)."""
    double_deletes: int
    unknown_deletes: int
    delete_problems: list[str]
    """One line per ``double_delete``/``unknown_delete`` event."""
    missing: list[str]
    """Chunks a keep event or an untrained step file names, neither present nor deleted by the ledger."""
    unreadable_step_files: list[str]
    bad_records: list[str]
    """Truncated or unparseable ledger records (tolerated: the writer died mid-write)."""
    stray_keys: list[str]
    """Keys where no refpipe object belongs (temp files of killed writers)."""
    live_sessions: list[str]
    """``<actor>/<session>`` of every live session."""
    violations: list[str]
    """Broken invariants, one line each; empty when the run is clean."""

    @computed_field
    @property
    def clean(self) -> bool:
        """No invariant is violated."""
        return not self.violations


class SweepResult(BaseModel):
    """What a sweep deleted (or, with ``dry_run``, would delete). Chunks by node URI."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dry_run: bool
    deleted: list[str]
    """Leaked committed chunks, claimed and deleted exactly once."""
    finished_deletes: list[str]
    """Chunks with a delete record whose leftover objects were removed."""
    removed_incomplete: list[str]
    """Incomplete keeps removed (never committed, so nothing to claim)."""
    conflicts: int = 0
    """Leaked chunks someone else deleted during the sweep (double or unknown deletes)."""


@dataclass
class RunScan:
    """Everything the audit reads, before judging it."""

    nodes: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Node key (``payloads/<shard>/<branch_id>``) -> every key listed under it."""
    tombstoned: set[str] = field(default_factory=set)
    steps: dict[int, StepHeader] = field(default_factory=dict)
    unreadable_steps: list[str] = field(default_factory=list)
    sessions: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    closed: set[tuple[str, str]] = field(default_factory=set)
    keeps: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Node key -> ``(actor, session)`` of its keep event."""
    received: set[str] = field(default_factory=set)
    released: dict[int, int] = field(default_factory=dict)
    """DP rank -> highest step it released."""
    problems: list[dict] = field(default_factory=list)
    bad_records: list[str] = field(default_factory=list)
    stray_keys: list[str] = field(default_factory=list)
    writers: dict[str, str] = field(default_factory=dict)
    """Node key -> writer, for the unshipped chunks without a keep event."""


def committed(keys: Sequence[str]) -> bool:
    """Whether a chunk node's keys include its commit marker."""
    return any(k.endswith("/" + META_KEY) for k in keys)


def _parallel(store: Store, fn: Callable[[T], R], items: Sequence[T], progress: Progress | None,
              description: str) -> list[R]:
    task = progress.add_task(description, total=len(items)) if progress else None
    out: list[R] = []
    with ThreadPoolExecutor(store.config.max_concurrent_fetches) as pool:
        for result in pool.map(fn, items):
            out.append(result)
            if progress:
                progress.advance(task)
    return out


def _list(store: Store, prefix: str, progress: Progress | None) -> list[str]:
    task = progress.add_task(f"listing {prefix}/", total=None) if progress else None
    keys = store.list_prefix(prefix)
    if progress:
        progress.update(task, total=len(keys), completed=len(keys))
    return keys


def scan_run(store: Store, progress: Progress | None = None) -> RunScan:
    """List and read everything the audit needs (no writes)."""
    scan = RunScan()
    for key in _list(store, "payloads", progress):
        parts = key.split("/")
        if len(parts) == 4:
            scan.nodes["/".join(parts[:3])].append(key)
        else:
            scan.stray_keys.append(key)
    for key in _list(store, "ledger/deletes", progress):
        if key.endswith(".json") and key.count("/") == 3:
            scan.tombstoned.add("payloads/" + key[len(DELETES_PREFIX):-len(".json")])
        else:
            scan.stray_keys.append(key)
    _scan_steps(store, scan, progress)
    _scan_events(store, scan, progress)
    _scan_writers(store, scan, progress)
    return scan


def _scan_steps(store: Store, scan: RunScan, progress: Progress | None) -> None:
    keys = []
    for key in _list(store, "steps", progress):
        (keys if _STEP_KEY.match(key) else scan.stray_keys).append(key)

    def read(key: str) -> StepHeader | str:
        try:
            return StepFile.from_bytes(store.get(key), store, store.uri(key)).header
        except (StepFileError, ChunkNotFoundError) as e:
            return f"{store.uri(key)}: {e}"

    for key, header in zip(keys, _parallel(store, read, keys, progress, "reading step files")):
        if isinstance(header, str):
            scan.unreadable_steps.append(header)
        elif step_key(header.step) != key:
            scan.unreadable_steps.append(f"{store.uri(key)}: holds step {header.step}")
        else:
            scan.steps[header.step] = header


def _scan_events(store: Store, scan: RunScan, progress: Progress | None) -> None:
    segments = []
    for key in _list(store, "ledger/events", progress):
        if parse_segment_key(key):
            segments.append(key)
        else:
            scan.bad_records.append(f"{store.uri(key)}: not a published segment (its writer died mid-put)")
    for key, data in zip(segments, _parallel(store, store.get, segments, progress, "reading ledger segments")):
        actor, session, _ = parse_segment_key(key)
        scan.sessions[actor].add(session)
        for number, line in enumerate(data.split(b"\n"), 1):
            if line:
                _take_event(scan, actor, session, line, f"{store.uri(key)} line {number}",
                            truncated=number == data.count(b"\n") + 1)


def _take_event(scan: RunScan, actor: str, session: str, line: bytes, where: str, truncated: bool) -> None:
    """Fold one ledger record into the scan; a bad record is noted, never fatal."""
    try:
        if truncated:
            raise ValueError("truncated record (no line end)")
        event = json.loads(line)
        kind = event["event"]
        if kind == "close":
            scan.closed.add((actor, session))
        elif kind == "keep":
            scan.keeps[node_key(event["branch_id"])] = (actor, session)
        elif kind == "receive":
            scan.received.update(node_key(b) for b in event["branch_ids"])
        elif kind == "release":
            rank, step = int(event["dp_rank"]), int(event["step"])
            scan.released[rank] = max(step, scan.released.get(rank, -1))
        elif kind in ("double_delete", "unknown_delete"):
            scan.problems.append(event)
    except (ValueError, KeyError, TypeError, ConfigError) as e:
        scan.bad_records.append(f"{where}: {type(e).__name__}: {e}")


def _scan_writers(store: Store, scan: RunScan, progress: Progress | None) -> None:
    """Writers of unshipped chunks without a keep event: from a drawn branch id, else ``zarr.json``."""
    shipped = {store.prefix.key_of(ref.uri) for h in scan.steps.values() for ref in h.refs}
    unnamed = []
    for node, keys in scan.nodes.items():
        if node in scan.keeps or node in shipped or node in scan.tombstoned:
            continue
        drawn = _DRAWN_ID.match(node.rpartition("/")[2])
        if drawn:
            scan.writers[node] = drawn["writer"]
        elif committed(keys):
            unnamed.append(node)

    def writer(node: str) -> str:
        try:
            return read_attributes(store.get(f"{node}/{META_KEY}")).get("writer", "")
        except (ChunkNotFoundError, ValueError, KeyError, TypeError):
            return ""

    scan.writers.update(zip(unnamed, _parallel(store, writer, unnamed, progress, "reading chunk writers")))


def _live_sessions(scan: RunScan, stopped: bool) -> set[tuple[str, str]]:
    if stopped:
        return set()
    latest = {actor: max(sessions, key=session_opened_ms) for actor, sessions in scan.sessions.items()}
    return {(actor, s) for actor, s in latest.items() if (actor, s) not in scan.closed}


def _step_nodes(store: Store, scan: RunScan) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """``(shipped, protected, borrowed)``: node -> step for every shipped chunk, node -> first
    untrained step for chunks of untrained steps, and the borrowed nodes."""
    shipped: dict[str, int] = {}
    protected: dict[str, int] = {}
    borrowed: set[str] = set()
    for step, header in sorted(scan.steps.items()):
        nodes = [store.prefix.key_of(ref.uri) for ref in header.refs]
        trained = all(scan.released.get(rank, -1) >= step for rank in set(header.owners))
        for node in nodes:
            shipped.setdefault(node, step)
            if not trained:
                protected.setdefault(node, step)
        borrowed |= {nodes[s.ref] for mb in header.micro_batches for s in mb.sequences if s.borrowed}
    return shipped, protected, borrowed


def _holder(node: str, keys: list[str], scan: RunScan, live: set[tuple[str, str]], shipped: dict[str, int],
            protected: dict[str, int]) -> str | None:
    """Who accounts for a present, undeleted chunk (module doc, rules 2-5); None: leaked."""
    live_actors = {actor for actor, _ in live}
    if node in protected:
        return f"trainer step {protected[node]}"
    keeper = scan.keeps.get(node)
    writer = keeper[0] if keeper else scan.writers.get(node, "")
    keeper_live = keeper in live if keeper else writer in live_actors
    if not committed(keys):
        return writer if keeper_live else ("incomplete keep" if live and not writer else None)
    if node in shipped:
        return None
    orchestrator_live = ORCHESTRATOR_ACTOR in live_actors
    if node in scan.received and orchestrator_live:
        return ORCHESTRATOR_ACTOR
    if keeper_live:
        return writer
    return ORCHESTRATOR_ACTOR if orchestrator_live else None


def judge(scan: RunScan, store: Store, *, stopped: bool = False, finished: bool = False) -> AuditReport:
    """Turn a scan into the audit report (module doc: holders, liveness, violations)."""
    stopped = stopped or finished
    live = _live_sessions(scan, stopped)
    shipped, protected, borrowed = _step_nodes(store, scan)
    holders: Counter[str] = Counter()
    leaked, unfinished = [], []
    for node, keys in sorted(scan.nodes.items()):
        if node in scan.tombstoned:
            unfinished.append(node)
        elif holder := _holder(node, keys, scan, live, shipped, protected):
            holders[holder] += 1
        else:
            leaked.append(node)
    expected = set(scan.keeps) | set(protected)
    missing = sorted(n for n in expected if n not in scan.nodes and n not in scan.tombstoned)
    doubles = [p for p in scan.problems if p.get("event") == "double_delete"]
    uri = store.uri
    report = dict(
        run_uri=store.prefix.uri, stopped=stopped, finished=finished,
        kept=sum(committed(k) for n, k in scan.nodes.items() if n not in scan.tombstoned) + len(scan.tombstoned),
        shipped=len(shipped), borrowed=len(borrowed), deleted=len(scan.tombstoned), present=len(scan.nodes),
        outstanding=sum(holders.values()), outstanding_by_holder=dict(sorted(holders.items())),
        leaked=len(leaked), leaked_chunks=[uri(n) for n in leaked],
        incomplete_keeps=[uri(n) for n, k in sorted(scan.nodes.items()) if not committed(k)],
        unfinished_deletes=[uri(n) for n in unfinished], double_deletes=len(doubles),
        unknown_deletes=len(scan.problems) - len(doubles), delete_problems=[_problem_line(p) for p in scan.problems],
        missing=[uri(n) for n in missing], unreadable_step_files=sorted(scan.unreadable_steps),
        bad_records=scan.bad_records, stray_keys=sorted(scan.stray_keys),
        live_sessions=sorted(f"{actor}/{session}" for actor, session in live),
    )
    return AuditReport(**report, violations=_violations(report))


def _problem_line(event: dict) -> str:
    first = f", first deleted by {event.get('first')}" if event.get("event") == "double_delete" else ""
    return f"{event.get('event')} of {event.get('uri') or event.get('branch_id')} by {event.get('actor')} " \
           f"({event.get('reason')}){first}"


def _violations(r: dict) -> list[str]:
    checks = [
        (r["leaked"], "leaked chunks (present, no live holder; `refpipe sweep` deletes them)"),
        (r["double_deletes"], "double deletes"),
        (r["unknown_deletes"], "deletes of unknown refs"),
        (len(r["unfinished_deletes"]), "unfinished deletes (delete record written, objects still present)"),
        (len(r["missing"]), "chunks missing without a delete record"),
        (len(r["unreadable_step_files"]), "unreadable step files"),
        (r["outstanding"] if r["finished"] else 0, "chunks still outstanding at the declared end of the run"),
    ]
    return [f"{n} {what}" for n, what in checks if n]


def audit(store: Store, *, stopped: bool = False, finished: bool = False,
          progress: Progress | None = None) -> AuditReport:
    """Audit a run: kept, shipped, deleted, outstanding by holder, leaks and ledger violations.

    Read-only. Cost: one listing each of ``payloads/``, ``steps/``, ``ledger/``; one GET per
    step file and per ledger segment; one GET of ``zarr.json`` per unshipped chunk whose
    writer neither a keep event nor its branch id names.

    Args:
        stopped: no process of the run is running (every session is dead).
        finished: the run is over (implies ``stopped``; outstanding chunks are violations).
        progress: a rich ``Progress`` to show listing and reading progress on.
    """
    return judge(scan_run(store, progress), store, stopped=stopped, finished=finished)


def sweep(store: Store, *, stopped: bool = False, dry_run: bool = False,
          progress: Progress | None = None) -> SweepResult:
    """Delete what a crash left without a live holder, exactly once and recorded (actor ``sweep``).

    Leaked committed chunks are claimed and deleted through ``Ledger.delete_nodes``; leftover
    objects of unfinished deletes and leaked incomplete keeps are removed (events
    ``finish_delete``, ``remove_incomplete``). Chunks of untrained step files are never touched.

    Args:
        stopped: as ``audit``: no process of the run is running.
        dry_run: list what would be deleted; write nothing.

    Raises:
        StepFileError: a step file is unreadable, so the chunks it may still hold are unknown.
    """
    scan = scan_run(store, progress)
    report = judge(scan, store, stopped=stopped)
    if report.unreadable_step_files:
        raise StepFileError(f"refusing to sweep {store.prefix.uri}: {len(report.unreadable_step_files)} unreadable "
                            f"step files may reference chunks; first: {report.unreadable_step_files[0]}")
    leaked = [store.prefix.key_of(u) for u in report.leaked_chunks]
    whole = {n: scan.nodes[n] for n in leaked if committed(scan.nodes[n])}
    incomplete = {n: scan.nodes[n] for n in leaked if n not in whole}
    unfinished = {n: scan.nodes[n] for n in map(store.prefix.key_of, report.unfinished_deletes)}
    if dry_run:
        return SweepResult(dry_run=True, deleted=[store.uri(n) for n in whole],
                           finished_deletes=report.unfinished_deletes, removed_incomplete=[store.uri(n) for n in incomplete])
    ledger = Ledger(store, SWEEP_ACTOR)
    try:
        result = ledger.delete_nodes(whole, reason=SWEEP_REASON)
    except (DoubleDeleteError, UnknownRefError) as e:
        result = e.result
    ledger.remove_leftovers(unfinished, event="finish_delete", reason=SWEEP_REASON)
    ledger.remove_leftovers(incomplete, event="remove_incomplete", reason=SWEEP_REASON)
    ledger.close()
    return SweepResult(dry_run=False, deleted=result.deleted, finished_deletes=report.unfinished_deletes,
                       removed_incomplete=[store.uri(n) for n in incomplete],
                       conflicts=len(result.double_deletes) + len(result.unknown))
