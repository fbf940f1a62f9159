"""The sweep: delete what a crash left without a live holder, exactly once and recorded (actor ``sweep``).

Which chunks are leaked, unfinished deletes or retained is the audit's judgement (``pipeline.audit.judge``:
the holder rules in ``pipeline.audit``'s module docstring); the sweep acts on exactly those. Leaked
committed chunks (and, with ``retained=True``, retained ones) are claimed and deleted through
``Ledger.delete_nodes``; leftover objects of unfinished deletes and leaked incomplete keeps are removed. It never
touches a chunk of an untrained or replayed step file (unless the run is abandoned), removes the record of a
suspended open branch before deleting its segments (``storage.ledger_open``: it can no longer be resumed), and
deletes nothing when a ledger record or step file is unreadable: the record may have named a holder.

``stopped`` is the user's declaration; the sweep checks it: it refuses while a session
of the run is live by its heartbeat, on any host. A plain sweep (not ``stopped``) never
deletes a chunk a live session holds.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from rich.progress import Progress

from refpipe.pipeline.audit import judge, live_sessions_of, refuse_if_running, step_nodes
from refpipe.pipeline.audit_scan import committed, scan_run
from refpipe.storage.delete_result import DeleteResult
from refpipe.storage.errors import DoubleDeleteError, LedgerRecordError, StepFileError, UnknownRefError
from refpipe.storage.layout import SWEEP_ACTOR
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_open import open_key
from refpipe.storage.store import Store

SWEEP_REASON = "sweep: no live holder (left behind by a crash)"
RETAINED_REASON = "sweep --retained: retained for inspection, no longer wanted"


class SweepResult(BaseModel):
    """What a sweep deleted (or, with ``dry_run``, would delete). Chunks by node URI."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dry_run: bool
    deleted: list[str]
    """Leaked committed chunks, claimed and deleted exactly once."""
    finished_deletes: list[str]
    """Unfinished deletes finished: leftover objects of a delete record removed, or a chunk whose holder's claim
    was never written claimed (by ``sweep``) and deleted."""
    removed_incomplete: list[str]
    """Incomplete keeps removed (never committed, so nothing to claim)."""
    retained: list[str] = []
    """Retained chunks claimed and deleted exactly once (``retained=True``)."""
    conflicts: int = 0
    """Leaked chunks someone else deleted during the sweep (double or unknown deletes)."""
    removed_directories: int = 0
    """Empty directories removed below the run prefix (``stopped``/``abandon`` only; none on S3)."""
    failed: list[str] = []
    """``<chunk URI>: <store error>`` of every chunk whose keys could not all be deleted (after the store's retries;
    not in the lists above): a later sweep finishes it."""


def sweep(store: Store, *, stopped: bool = False, dry_run: bool = False, abandon: bool = False,
          force: bool = False, retained: bool = False, progress: Progress | None = None) -> SweepResult:
    """Delete what a crash left without a live holder, exactly once and recorded (actor ``sweep``).

    Leaked committed chunks are claimed and deleted through ``Ledger.delete_nodes``; leftover
    objects of unfinished deletes and leaked incomplete keeps are removed (events
    ``finish_delete``, ``remove_incomplete``). The record of a suspended open branch whose segments it deletes (a
    finished or abandoned run's) is removed first, so it can no longer be resumed. Chunks of untrained step files and
    of steps a resume replays (``_replayed``) are never touched, unless the run is abandoned. A ``stopped`` or
    ``abandon`` sweep then removes the empty directories below the run prefix (``Store.remove_empty_directories``:
    payload shards of deleted chunks; none on S3).

    Args:
        stopped: as ``audit``: no process of the run is running. Checked by the sessions'
            heartbeats (refused while one is live, on any host).
        dry_run: list what would be deleted; write nothing.
        abandon: the run is stopped and will never be resumed: chunks of untrained step files are
            deleted too, so ``audit --finished`` is clean afterwards. Implies ``stopped``.
        force: skip the liveness check (``stopped``/``abandon`` even while a session's heartbeat
            is live, e.g. a process outside the run reuses the actor's name; without them, live
            sessions then hold nothing either).
        retained: also delete the chunks retained for inspection (``trainer.retain_steps``), each
            exactly once; afterwards ``show``/``verify`` report them as deleted.

    Raises:
        RunStillRunningError: ``stopped`` or ``abandon`` while a session of the run is live by its heartbeat,
            on any host (nothing deleted).
        StepFileError: a step file is unreadable, so the chunks it may still hold are unknown (nothing deleted).
        LedgerRecordError: a ledger record is unreadable (``AuditReport.bad_records``): it may be the only
            evidence of a holder, so nothing is deleted, not even with ``abandon`` or ``dry_run``.
    """
    scan = scan_run(store, progress)
    live = live_sessions_of(store, scan) if not force else set()
    if stopped or abandon:
        refuse_if_running(store, live, scan)
    report = judge(scan, store, stopped=stopped, abandoned=abandon, live=live)
    if report.unreadable_step_files:
        raise StepFileError(f"refusing to sweep {store.prefix.uri}: {len(report.unreadable_step_files)} unreadable "
                            f"step files may reference chunks; first: {report.unreadable_step_files[0]} (restore it, "
                            f"or move it out of the run once no trainer will read it: its chunks then count as never "
                            f"shipped, and the sweep deletes those no one holds)")
    if report.bad_records:
        raise LedgerRecordError(f"refusing to sweep {store.prefix.uri}: {len(report.bad_records)} unreadable ledger "
                                f"records may be the only evidence of a holder; first: {report.bad_records[0]} "
                                f"(repair the record or remove its line, then sweep again)")
    leaked = [store.prefix.key_of(u) for u in report.leaked_chunks]
    shipped = step_nodes(scan)[0]
    whole = {n: scan.nodes[n] for n in leaked if committed(scan.nodes[n]) or n in shipped}  # claimed, recorded
    incomplete = {n: scan.nodes[n] for n in leaked if n not in whole}
    unfinished = {n: scan.nodes[n] for n in map(store.prefix.key_of, report.unfinished_deletes)}
    unclaimed = {n: keys for n, keys in unfinished.items() if n not in scan.tombstoned}  # the claim was never written
    kept = {n: scan.nodes[n] for n in map(store.prefix.key_of, report.retained_chunks)} if retained else {}
    if dry_run:
        return SweepResult(dry_run=True, deleted=[store.uri(n) for n in whole],
                           finished_deletes=report.unfinished_deletes,
                           removed_incomplete=[store.uri(n) for n in incomplete], retained=[store.uri(n) for n in kept])
    suspended = sorted({scan.open_nodes[n] for n in whole if n in scan.open_nodes})
    store.delete_keys([open_key(b) for b in suspended])  # first: a crash after it leaves leaked segments, no record
    ledger = Ledger(store, SWEEP_ACTOR)
    result = _delete_nodes(ledger, whole, SWEEP_REASON)
    gone = _delete_nodes(ledger, kept, RETAINED_REASON)
    claimed = _delete_nodes(ledger, unclaimed, SWEEP_REASON)
    failed = {**result.failed, **gone.failed, **claimed.failed}
    failed |= ledger.remove_leftovers({n: k for n, k in unfinished.items() if n not in unclaimed},
                                      event="finish_delete", reason=SWEEP_REASON)
    failed |= ledger.remove_leftovers(incomplete, event="remove_incomplete", reason=SWEEP_REASON)
    ledger.close()
    return SweepResult(dry_run=False, deleted=result.deleted,
                       finished_deletes=[u for u in report.unfinished_deletes if u not in failed],
                       removed_incomplete=[store.uri(n) for n in incomplete if store.uri(n) not in failed],
                       retained=gone.deleted, failed=[f"{uri}: {error}" for uri, error in sorted(failed.items())],
                       conflicts=sum(len(r.double_deletes) + len(r.unknown) for r in (result, gone, claimed)),
                       removed_directories=store.remove_empty_directories() if stopped or abandon else 0)


def _delete_nodes(ledger: Ledger, nodes: dict[str, list[str]], reason: str) -> DeleteResult:
    """``Ledger.delete_nodes``; chunks someone else deleted meanwhile are in the result, not raised."""
    try:
        return ledger.delete_nodes(nodes, reason=reason)
    except (DoubleDeleteError, UnknownRefError) as e:
        assert e.result is not None  # Ledger.delete_nodes raises these with the call's result
        return e.result
