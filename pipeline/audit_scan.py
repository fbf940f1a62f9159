"""Reading a run for the audit: listings, step files, ledger segments, chunk writers (no writes).

``scan_run`` lists ``payloads/``, ``ledger/deletes/``, ``steps/`` and ``ledger/events/`` once each, reads every
step file and ledger segment (in parallel, with progress), and reads ``zarr.json`` only for unshipped chunks whose
writer neither a keep event nor a drawn branch id (``<actor>-<uuid4 hex>``, as ``Keeper.keep`` draws them) names.
Bad ledger records (``storage.ledger_records.read_segment``: not JSON, no event name, a crc32c that does not
match, no line end, or fields of the wrong type) are collected by segment URI and line, never fatal
to the scan; the audit counts them as a violation and the sweep refuses to delete on such a ledger.
A key under ``ledger/events/`` that is not a segment name (a temp file of a killed writer) is a stray key.

Delete records are listed, never read: reading them would cost one GET per deleted chunk.
Each is written whole by one exclusive put (temp file + link, or one PUT), so a deleter
that dies mid-write leaves a temp file (a stray key), never a truncated record; and the
record's existence is the claim, its body only says who claimed it. The deleter that loses
a claim reads the winner's record and reports an unreadable one (``Ledger.delete``).
Release records (``ledger/deletes/releases/step_<N:08d>/<actor>.json``, ``Ledger.release`` on S3: one claim for a
DP rank's chunks of one step) and a filesystem's delete batch records (``storage.ledger_batch``) are read, one GET
each (an incremental audit reads those not settled): every chunk one lists has a delete record. A chunk that two
records claim is a double delete (``double_claims``): the claims of a release and of another deleter do not see each
other at delete time (``storage.ledger_release``). Other keys under ``ledger/deletes/`` are stray keys.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from rich.progress import Progress

from refpipe.pipeline.step_file import StepFile, check_step
from refpipe.pipeline.step_header import StepHeader
from refpipe.storage.chunk_codec import read_writer
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.errors import (
    ConfigError,
    DeleteRecordError,
    KeyNotFoundError,
    OpenBranchError,
    RunNotFoundError,
    StepFileError,
)
from refpipe.storage.layout import (
    BATCHES_PREFIX,
    DELETES_PREFIX,
    EVENTS_PREFIX,
    META_NAME,
    PAYLOADS_PREFIX,
    RELEASES_PREFIX,
    STEPS_PREFIX,
    branch_id_of,
    drawn_writer,
    meta_key,
    node_key,
    parse_payload_key,
    parse_release_key,
    parse_segment_key,
    parse_step_key,
    parse_tombstone_key,
    step_key,
    tombstone_key,
)
from refpipe.storage.ledger_holds import HOLDS_PREFIX, parse_hold_key
from refpipe.storage.ledger_open import read_suspended
from refpipe.storage.ledger_records import ReleaseRecord, delete_holder, read_release_record, read_segment
from refpipe.storage.store import Store

T = TypeVar("T")
R = TypeVar("R")


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
    opens: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    """``(actor, session)`` -> ``(pid, host)`` its ``open`` event recorded."""
    keeps: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Node key -> ``(actor, session)`` of its keep event."""
    holds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Node key of a shared prefix -> its declared holders (its keep event)."""
    released_holds: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Node key of a shared prefix -> the holders whose release is recorded (``storage.ledger_holds``)."""
    suspended: set[str] = field(default_factory=set)
    """Branch ids a ``suspend`` event names (``storage.ledger_open``)."""
    open_nodes: dict[str, str] = field(default_factory=dict)
    """Node key -> branch id of a suspended open branch whose record still names it."""
    received: set[str] = field(default_factory=set)
    released: dict[int, int] = field(default_factory=dict)
    """DP rank -> highest step it released."""
    trained: dict[int, int] = field(default_factory=dict)
    """DP rank -> highest step it trained (``trained`` events of ``release = "after_checkpoint"``)."""
    retained: set[str] = field(default_factory=set)
    """Node keys handed to the ``retained`` holder (``retain`` events)."""
    unfinished: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Node key -> ``(actor, session)`` of an ``unfinished_delete`` event: that holder decided to delete the chunk
    and its claim or the removal of its objects failed (the last such event per chunk)."""
    problems: list[dict] = field(default_factory=list)
    bad_records: list[str] = field(default_factory=list)
    """``<segment URI> line <n>: <error>`` of every ledger record that could not be read or folded."""
    stray_keys: list[str] = field(default_factory=list)
    writers: dict[str, str] = field(default_factory=dict)
    """Node key -> writer, for the unshipped chunks without a keep event."""
    covered_segments: set[str] = field(default_factory=set)
    """Segment keys folded into this scan (from an audit summary, then every one read)."""
    settled_steps: set[int] = field(default_factory=set)
    """Steps an audit summary settled: not read (``pipeline.audit_summary``)."""
    settled: Counter = field(default_factory=Counter)
    """Settled chunks counted by an audit summary: ``kept``, ``deleted``, ``shipped``, ``borrowed``."""
    releases_read: set[str] = field(default_factory=set)
    """Release record keys read (``claims``)."""
    settled_batches: set[str] = field(default_factory=set)
    """Delete batch records an audit summary settled: not read."""
    batch_nodes: dict[str, set[str]] = field(default_factory=dict)
    """Delete batch record read -> the nodes it claims."""
    claims: dict[str, list[tuple[str, str, str]]] = field(default_factory=lambda: defaultdict(list))
    """Node key -> ``(holder, reason, session)`` of every release or delete batch record that claims it."""
    folded: set[str] = field(default_factory=set)
    """Nodes whose release claims are in ``tombstoned`` and ``double_claims``."""
    double_claims: list[dict] = field(default_factory=list)
    """``double_delete`` problems (as ledger events) of chunks two records claim; recomputed by every audit."""


class StaleSummaryError(Exception):
    """A segment or step file an audit summary covers is no longer listed: the summary is not used."""


def committed(keys: Sequence[str]) -> bool:
    """Whether a chunk node's keys include its commit marker."""
    return any(k.endswith("/" + META_NAME) for k in keys)


def _parallel(store: Store, fn: Callable[[T], R], items: Sequence[T], progress: Progress | None,
              description: str) -> list[R]:
    if progress is None:
        return bounded_map(fn, items, store.config.max_concurrent_scan_ops)
    task = progress.add_task(description, total=len(items))
    return bounded_map(fn, items, store.config.max_concurrent_scan_ops, on_result=lambda _: progress.advance(task))


def _list(store: Store, prefix: str, progress: Progress | None) -> list[str]:
    task = progress.add_task(f"listing {prefix}/", total=None) if progress else None
    keys = store.list_prefix(prefix)
    if progress and task is not None:
        progress.update(task, total=len(keys), completed=len(keys))
    return keys


def scan_run(store: Store, progress: Progress | None = None, seed: RunScan | None = None) -> RunScan:
    """List and read everything the audit needs (no writes).

    Read in the order that keeps an audit of a live run free of false alarms: step files
    and ledger events first (evidence of holding is never newer than the listing of
    chunks), delete records before chunks (a record older than a present chunk means an
    unfinished delete), and a final check of the delete record of every chunk that a keep
    event or step file names but that was neither listed nor present (deleted meanwhile).

    ``seed``: what an audit summary covers (``pipeline.audit_summary.seed_scan``); its segments and
    settled steps are not read, and delete records are checked per named chunk instead of listed.

    Raises:
        StaleSummaryError: a segment or step file ``seed`` covers is no longer listed.
    """
    scan = seed or RunScan()
    _scan_steps(store, scan, progress)
    _scan_events(store, scan, progress)
    for key in _list(store, HOLDS_PREFIX, progress) if scan.holds else ():  # only a run with shared prefixes
        if hold := parse_hold_key(key):
            scan.released_holds[node_key(hold[0])].add(hold[1])
    _scan_suspended(store, scan)
    if seed is None:
        _list_deletes(store, scan, progress)
    else:
        _check_deletes(store, scan, _named(scan), progress)
        _read_releases(store, scan, _list(store, RELEASES_PREFIX, progress), progress)
        _fold_releases(store, scan, _named(scan))
    for key in _list(store, PAYLOADS_PREFIX, progress):
        if parsed := parse_payload_key(key):
            scan.nodes[parsed[0]].append(key)
        else:
            scan.stray_keys.append(key)
    if seed is not None:
        _check_deletes(store, scan, set(scan.nodes) - _named(scan), progress)
        if any(n not in scan.tombstoned and n not in scan.claims for n in set(scan.nodes) - _named(scan)):
            scan.settled_batches.clear()  # a present chunk nothing names: a settled batch record may claim it
            _read_releases(store, scan, _list(store, BATCHES_PREFIX, progress), progress)
        _fold_releases(store, scan, set(scan.nodes))
    _recheck_deletes(store, scan, progress)
    _scan_writers(store, scan, progress)
    if not (scan.nodes or scan.tombstoned or scan.steps or scan.unreadable_steps or scan.sessions or scan.stray_keys
            or scan.settled_steps):
        raise RunNotFoundError(f"nothing under the run prefix {store.prefix.uri}: wrong URI or endpoint?")
    return scan


def _scan_suspended(store: Store, scan: RunScan) -> None:
    """The segments of every suspended open branch whose record still exists (one read per ``suspend`` event's
    branch); an unreadable record is a bad record."""
    for branch_id in sorted(scan.suspended):
        try:
            record = read_suspended(store, branch_id)
        except OpenBranchError as e:
            scan.bad_records.append(str(e))
            continue
        for segment in record.segments if record else ():
            scan.open_nodes[segment.key] = branch_id


def _list_deletes(store: Store, scan: RunScan, progress: Progress | None) -> None:
    keys = _list(store, DELETES_PREFIX, progress)
    scan.tombstoned.update(node for key in keys if (node := parse_tombstone_key(key)))
    scan.stray_keys += [key for key in keys if not parse_tombstone_key(key) and not parse_release_key(key)]
    _read_releases(store, scan, [key for key in keys if parse_release_key(key)], progress)
    _fold_releases(store, scan, set(scan.claims))


def _read_releases(store: Store, scan: RunScan, keys: list[str], progress: Progress | None) -> None:
    """Read the release records ``keys`` not read yet (and not of a settled step) into ``claims``; an unreadable
    record is a bad record (it may claim chunks)."""
    new = [k for k in keys if k not in scan.releases_read and k not in scan.settled_batches
           and (parsed := parse_release_key(k)) is not None and parsed[0] not in scan.settled_steps]

    def read(key: str) -> ReleaseRecord | DeleteRecordError | KeyNotFoundError:
        try:
            return read_release_record(store.get(key), store.uri(key))
        except (DeleteRecordError, KeyNotFoundError) as e:
            return e

    for key, record in zip(new, _parallel(store, read, new, progress, "reading release records")):
        scan.releases_read.add(key)
        if not isinstance(record, ReleaseRecord):
            scan.bad_records.append(f"{store.uri(key)}: {type(record).__name__}: {record}")
            continue
        for branch_id in record.branch_ids:
            scan.claims[node_key(branch_id)].append((record.holder, record.reason, record.session))
        if record.step is None:
            scan.batch_nodes[key] = {node_key(b) for b in record.branch_ids}


def _fold_releases(store: Store, scan: RunScan, nodes: set[str]) -> None:
    """Count the release claims of ``nodes`` as delete records (as ``_check_deletes`` checks a node's own): a node
    that a delete record or another release record claims too is a double delete, once per extra claim, unless an
    earlier claim is the same actor's in another session (its earlier life: already released, as at delete time).
    An incremental audit folds only the nodes it checks (named or present), never settled ones."""
    for node in sorted(n for n in nodes if n in scan.claims and n not in scan.folded):
        claims = scan.claims[node]
        first, first_reason = delete_holder(store, branch_id_of(node)) if node in scan.tombstoned else claims[0][:2]
        for i, (holder, reason, session) in enumerate(claims):
            if (i or node in scan.tombstoned) and not any(h == holder and s != session for h, _, s in claims[:i]):
                scan.double_claims.append({"event": "double_delete", "branch_id": branch_id_of(node),
                                           "uri": store.uri(node), "actor": holder, "reason": reason, "first": first,
                                           "first_reason": first_reason})
        scan.tombstoned.add(node)
        scan.folded.add(node)


def _named(scan: RunScan) -> set[str]:
    """Chunks a keep, receive, retain or unfinished_delete event or a step file read names."""
    return set(scan.keeps) | scan.received | scan.retained | set(scan.unfinished) \
        | {n for h in scan.steps.values() for ref in h.refs for n in ref.nodes}


def _check_deletes(store: Store, scan: RunScan, nodes: set[str], progress: Progress | None) -> None:
    """One ``exists`` of the delete record of each of ``nodes`` (an incremental audit lists none)."""
    ordered = sorted(nodes)
    found = _parallel(store, lambda n: store.exists(tombstone_key(branch_id_of(n))), ordered, progress,
                      "checking delete records")
    scan.tombstoned.update(n for n, deleted in zip(ordered, found) if deleted)


def _recheck_deletes(store: Store, scan: RunScan, progress: Progress | None) -> None:
    named = set(scan.keeps) | {n for h in scan.steps.values() for ref in h.refs for n in ref.nodes}
    gone = sorted(n for n in named if n not in scan.nodes and n not in scan.tombstoned)
    if gone:  # released meanwhile (after the release records were read)?
        _read_releases(store, scan, _list(store, RELEASES_PREFIX, progress), progress)
        _fold_releases(store, scan, set(gone))
        gone = [n for n in gone if n not in scan.tombstoned]
    found = _parallel(store, lambda n: store.exists(tombstone_key(branch_id_of(n))), gone, progress,
                      "checking delete records")
    scan.tombstoned.update(n for n, deleted in zip(gone, found) if deleted)


def _scan_steps(store: Store, scan: RunScan, progress: Progress | None) -> None:
    keys, listed = [], set()
    for key in _list(store, STEPS_PREFIX, progress):
        step = parse_step_key(key)
        if step is None:
            scan.stray_keys.append(key)
        elif step in scan.settled_steps and step_key(step) == key:
            listed.add(step)
        else:
            keys.append(key)
    if gone := scan.settled_steps - listed:
        raise StaleSummaryError(f"{len(gone)} settled step files are gone, e.g. {store.uri(step_key(min(gone)))}")

    def read(key: str) -> StepHeader | str:
        step = parse_step_key(key)
        assert step is not None  # keys holds step file names only (the listing above)
        if step_key(step) != key:
            return f"{store.uri(key)}: not a step file name (expected {step_key(step)})"
        try:  # parse: a damaged stream member does not hide which chunks the header holds
            step_file = StepFile.parse(store.get(key), store.uri(key))
            check_step(step_file.header, step, step_file.uri)
            return step_file.header
        except (StepFileError, KeyNotFoundError) as e:
            return f"{store.uri(key)}: {e}"

    for header in _parallel(store, read, keys, progress, "reading step files"):
        if isinstance(header, str):
            scan.unreadable_steps.append(header)
        else:
            scan.steps[header.step] = header


def _scan_events(store: Store, scan: RunScan, progress: Progress | None) -> None:
    segments, listed = [], set()
    for key in _list(store, EVENTS_PREFIX, progress):
        if not parse_segment_key(key):
            scan.stray_keys.append(key)
        elif key in scan.covered_segments:
            listed.add(key)
        else:
            segments.append(key)
    if gone := scan.covered_segments - listed:
        raise StaleSummaryError(f"{len(gone)} ledger segments the audit summary covers are gone, e.g. {min(gone)}")
    scan.covered_segments.update(segments)
    for key, data in zip(segments, _parallel(store, store.get, segments, progress, "reading ledger segments")):
        parsed = parse_segment_key(key)
        assert parsed is not None  # segments holds segment keys only (the listing above)
        actor, session, _ = parsed
        scan.sessions[actor].add(session)
        for number, event in read_segment(data):
            _take_event(scan, actor, session, event, f"{store.uri(key)} line {number}")


def _take_event(scan: RunScan, actor: str, session: str, event: dict | ValueError, where: str) -> None:
    """Fold one ledger record (``storage.ledger_records.read_segment``) into the scan; a bad record is noted, never
    fatal."""
    try:
        if isinstance(event, ValueError):
            raise event
        kind = event["event"]
        if kind == "close":
            scan.closed.add((actor, session))
        elif kind == "open":
            pid = int(event["pid"])
            if pid <= 0:
                raise ValueError(f"open event with pid {pid}")
            scan.opens[(actor, session)] = (pid, str(event["host"]))
        elif kind == "keep":
            scan.keeps[node_key(event["branch_id"])] = (actor, session)
            if event.get("holders"):
                scan.holds[node_key(event["branch_id"])] = tuple(str(h) for h in event["holders"])
        elif kind == "suspend":
            scan.suspended.add(str(event["branch_id"]))
        elif kind == "receive":
            scan.received.update(node_key(b) for b in event["branch_ids"])
        elif kind in ("release", "trained"):
            rank, step = int(event["dp_rank"]), int(event["step"])
            latest = scan.released if kind == "release" else scan.trained
            latest[rank] = max(step, latest.get(rank, -1))
        elif kind == "retain":
            scan.retained.update(node_key(b) for b in event["branch_ids"])
        elif kind == "unfinished_delete":
            scan.unfinished[node_key(event["branch_id"])] = (actor, session)
        elif kind in ("double_delete", "unknown_delete"):
            scan.problems.append(event)
    except (ValueError, KeyError, TypeError, ConfigError) as e:
        scan.bad_records.append(f"{where}: {type(e).__name__}: {e}")


def _scan_writers(store: Store, scan: RunScan, progress: Progress | None) -> None:
    """Writers of unshipped chunks without a keep event: from a drawn branch id, else ``zarr.json``."""
    shipped = {n for h in scan.steps.values() for ref in h.refs for n in ref.nodes}
    unnamed = []
    for node, keys in scan.nodes.items():
        if node in scan.keeps or node in shipped or node in scan.tombstoned:
            continue
        drawn = drawn_writer(branch_id_of(node))
        if drawn:
            scan.writers[node] = drawn
        elif committed(keys):
            unnamed.append(node)

    def writer(node: str) -> str:
        try:
            return read_writer(store.get(meta_key(node))) or ""
        except KeyNotFoundError:
            return ""

    scan.writers.update(zip(unnamed, _parallel(store, writer, unnamed, progress, "reading chunk writers")))
