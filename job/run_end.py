"""The end of a run's life, in the orchestrator role: the ledger audit, the final sweep, ``summary.json``.

Called once, after the fleet stopped and the orchestrator shut down (``job.launcher``). The run is
audited as stopped (finished unless it failed); what dead workers and failed deletes left is swept and
audited again; the summary table is printed and written to ``<run>/summary.json`` with the cost plot
``<run>/report.png``. The exit code says whether the audit and the alignment check passed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from rich.console import Console

from refpipe.job.config import RunConfig
from refpipe.job.progress import ProgressView
from refpipe.job.report import RunTally
from refpipe.job.resume import LifeStart
from refpipe.job.text import markup_safe
from refpipe.pipeline.audit import AuditReport, audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.layout import REPORT_KEY, SUMMARY_KEY
from refpipe.storage.store import Store

UNREPORTED_DELETES = "unreported (earlier lives, stopped processes)"
"""The path of the deletes no process of this life reported: an earlier life's, and the last releases of trainer
ranks stopped before their next metrics (step ``s``'s metrics count the release of step ``s - 2``)."""
DOUBLE_COUNTED_DELETES = "counted twice above"
"""The path of a negative rest: a path counted a delete another finished too (the orchestrator counts a failed
delete, which the final sweep finishes)."""


@dataclass(frozen=True)
class RunEnd:
    """How a life of the run ended, as the orchestrator role saw it."""

    trained: int
    """Steps trained (``0 .. trained - 1``)."""
    dead_workers: list[int]
    """Env-server replicas that died during the run."""
    failure: str | None
    """Why the run stopped early (``<error type>: <message>``, ``interrupted (SIGTERM)``); None: it ran to its end."""
    signals: list[int]
    """SIGINT/SIGTERM received (the first sets the exit code)."""
    life: LifeStart | None
    """Where a later life started; None for the first life."""


def finish_run(cfg: RunConfig, store: Store, console: Console, view: ProgressView, tally: RunTally,
               end: RunEnd) -> int:
    """Audit the run, sweep what dead workers and failed deletes left (audited again), remove the empty
    directories the finished run leaves (local backend: the payload shards), print the summary; return the
    exit code: 0 audit clean and alignment within tolerance, 128 + the signal's number after SIGINT/SIGTERM
    (130, 143), else 1.

    A failed run is audited as stopped, not finished: untrained step files keep their chunks
    for a restart, and ``refpipe sweep`` is left to the user.
    """
    failed = end.failure is not None
    report: AuditReport = audit(store, stopped=True, finished=not failed)
    # what dead workers left, deletes that failed; never on a ledger with unreadable records (the sweep refuses)
    if (end.dead_workers or report.unfinished_deletes) and not (failed or report.bad_records):
        swept = sweep(store)  # dead sessions judged by heartbeats: safe while remote roles are closing
        tally.deletes["sweep"] += len(swept.deleted)
        tally.deletes["sweep: unfinished deletes finished"] += len(swept.finished_deletes)
        report = audit(store, stopped=True, finished=True)
    tally.deletes = with_unreported(tally.deletes, report.deleted)
    removed_directories = 0 if failed else store.remove_empty_directories()  # every role has finished
    alignment_ok = tally.alignment_max < cfg.job.alignment_tolerance
    resumed = None if end.life is None else {
        "life": end.life.life, "from_checkpoint_step": end.life.checkpoint_step,
        "replayed_steps": tally.lives["replayed"], "skipped_steps": tally.lives["skipped"],
        "reclaimed_chunks": tally.lives["reclaimed"]}
    view.summary(report, tally.deletes, tally.alignment_max, alignment_ok, dead_workers=end.dead_workers,
                 failure=end.failure, resumed=resumed,
                 release=(cfg.trainer.release, tally.costs.peak_held_for_checkpoint_bytes()))
    summary = {"resumed": resumed, "failed": failed, "failure": end.failure, "trained_steps": end.trained,
               "rewards": tally.rewards,
               "deletes": dict(tally.deletes), "retained_chunks": report.retained,
               "alignment_max_abs_diff": tally.alignment_max,
               "alignment_on_policy_tokens": tally.alignment_tokens,
               "alignment_ok": alignment_ok, "dead_env_workers": end.dead_workers, "audit": report.model_dump(),
               "removed_empty_directories": removed_directories,
               **tally.costs.summary()}
    store.put(SUMMARY_KEY, json.dumps(summary, indent=2).encode())
    store.put(REPORT_KEY, tally.costs.plot(f"run {store.prefix.uri}"))
    console.print(f"wrote {markup_safe(store.uri(SUMMARY_KEY))} and {markup_safe(store.uri(REPORT_KEY))}",
                  soft_wrap=True, highlight=False)
    if end.signals:
        return 128 + end.signals[0]
    return 0 if report.clean and alignment_ok and not failed else 1


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
