"""The checkpointed audit summary: what an incremental audit (``audit(incremental=True)``) need not read again.

Stored at ``ledger/audit/summary.json`` (``storage.layout.AUDIT_SUMMARY_KEY``), rewritten whole by each
incremental audit (a plain put: two auditors racing each write a correct summary). It records:

- ``segments``: the ledger segments already folded, and the fold of their events (sessions, opens, closes,
  keeps, receives, releases, trained, retains, unfinished, double and unknown deletes, bad records). Segments are
  written once by an exclusive put and never change, so a fold stays true.
- ``settled_steps`` and ``settled`` counts: a chunk is *settled* once its delete record exists and its
  objects are gone; a step once every chunk it ships is settled; ``settled_batches``: a filesystem's delete
  batch records whose every chunk settled in the same audit (not read again, unless a present chunk that nothing
  names needs its claim looked for; one settled over several audits is read each time). A settled chunk's state
  is final (branch ids are never reused), so it only adds to the counts ``kept``, ``deleted``, ``shipped`` and
  ``borrowed``; its keep, receive and retain entries are dropped and its step file is not read again.

What an incremental audit still reads: the listings of ``steps/``, ``ledger/events/`` and ``payloads/``
(payloads hold only chunks in flight), the step files and segments not covered, and one ``exists`` of the
delete record of every chunk that a kept-but-unsettled entry, an unsettled step file or a present node names.
Delete records are not listed: one that nothing names (its keep event lost with its writer, and never present
since) and stray keys under ``ledger/deletes/`` are seen by a full audit only.

Verified before use: the summary must parse (version 1), and every covered segment and settled step file must
still be listed; otherwise it is ignored (``stale``) and the audit reads the run in full. Exactly-once is not
the summary's to prove: each chunk's delete record is its claim; the summary only remembers that a record
was seen and the chunk's objects were gone.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from refpipe.pipeline.audit_scan import RunScan
from refpipe.storage.errors import KeyNotFoundError
from refpipe.storage.layout import AUDIT_SUMMARY_KEY
from refpipe.storage.store import Store

SETTLED_COUNTS = ("kept", "deleted", "shipped", "borrowed")


class AuditSummary(BaseModel):
    """An incremental audit's checkpoint (module doc). Node keys are ``payloads/<shard>/<branch_id>``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    segments: list[str]
    """Ledger segment keys folded into the fields below."""
    settled_steps: list[int]
    """Steps whose every chunk is settled: their files are not read again."""
    settled_batches: list[str] = []
    """Delete batch records (``storage.ledger_batch``) whose every chunk settled in one audit: not read again."""
    settled: dict[str, int]
    """``kept``, ``deleted``, ``shipped``, ``borrowed``: chunks settled, counted once each."""
    sessions: dict[str, list[str]]
    closed: list[tuple[str, str]]
    opens: list[tuple[str, str, int, str]]
    """``(actor, session, pid, host)`` of each ``open`` event."""
    keeps: dict[str, tuple[str, str]]
    """Unsettled node -> ``(actor, session)`` of its keep event."""
    received: list[str]
    released: dict[int, int]
    trained: dict[int, int]
    retained: list[str]
    unfinished: dict[str, tuple[str, str]]
    """Unsettled node -> ``(actor, session)`` of its last ``unfinished_delete`` event."""
    problems: list[dict]
    bad_records: list[str]


def load_summary(store: Store) -> AuditSummary | None:
    """The run's summary, or None when there is none or it does not parse (then the audit reads everything)."""
    try:
        return AuditSummary.model_validate_json(store.get(AUDIT_SUMMARY_KEY))
    except (KeyNotFoundError, ValidationError, ValueError):
        return None


def seed_scan(summary: AuditSummary) -> RunScan:
    """A scan holding what ``summary`` covers, to fold the new step files and segments into."""
    scan = RunScan(settled=Counter(summary.settled), covered_segments=set(summary.segments),
                   settled_steps=set(summary.settled_steps), settled_batches=set(summary.settled_batches),
                   keeps=dict(summary.keeps),
                   received=set(summary.received), released=dict(summary.released), trained=dict(summary.trained),
                   retained=set(summary.retained), unfinished=dict(summary.unfinished), problems=list(summary.problems),
                   bad_records=list(summary.bad_records), closed=set(summary.closed),
                   opens={(a, s): (pid, host) for a, s, pid, host in summary.opens})
    for actor, sessions in summary.sessions.items():
        scan.sessions[actor].update(sessions)
    return scan


def settle(scan: RunScan) -> AuditSummary:
    """The summary after ``scan``: its chunks with a delete record and no objects left, and not shipped by a step
    that is still open, become settled counts; steps whose every chunk is settled become settled steps."""
    step_nodes = {step: {n for ref in h.refs for n in ref.nodes} for step, h in scan.steps.items()}
    open_steps = {s for s, nodes in step_nodes.items() if not nodes <= scan.tombstoned or nodes & scan.nodes.keys()}
    in_open_steps = set().union(*(step_nodes[s] for s in open_steps))
    done = {n for n in scan.tombstoned if n not in scan.nodes and n not in in_open_steps}
    settled = Counter(scan.settled)
    settled.update(kept=len(done), deleted=len(done))
    closing = sorted(set(step_nodes) - open_steps)
    shipped = set().union(*(step_nodes[s] for s in closing))
    borrowed = {n for s in closing for mb in scan.steps[s].micro_batches for q in mb.sequences
                if q.borrowed and q.ref is not None  # (StepHeader: a borrowed one has a ref)
                for n in scan.steps[s].refs[q.ref].nodes}
    settled.update(shipped=len(shipped), borrowed=len(borrowed))
    return AuditSummary(
        segments=sorted(scan.covered_segments), settled_steps=sorted(scan.settled_steps | set(closing)),
        settled_batches=sorted(scan.settled_batches | {k for k, nodes in scan.batch_nodes.items() if nodes <= done}),
        settled={k: settled[k] for k in SETTLED_COUNTS},
        sessions={a: sorted(s) for a, s in sorted(scan.sessions.items())}, closed=sorted(scan.closed),
        opens=[(a, s, pid, host) for (a, s), (pid, host) in sorted(scan.opens.items())],
        keeps={n: k for n, k in scan.keeps.items() if n not in done},
        received=sorted(scan.received - done), released=scan.released, trained=scan.trained,
        retained=sorted(scan.retained - done), unfinished={n: c for n, c in scan.unfinished.items() if n not in done},
        problems=scan.problems,
        bad_records=scan.bad_records)


def write_summary(store: Store, summary: AuditSummary) -> None:
    """Replace the run's summary (a plain put: readers see the old or the new one whole)."""
    store.put(AUDIT_SUMMARY_KEY, summary.model_dump_json().encode())
