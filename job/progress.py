"""What the user sees during ``refpipe run``: one line per trained step, then the audit summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from refpipe.job.text import markup_safe
from refpipe.pipeline.audit import AuditReport
from refpipe.pipeline.step_header import StepHeader
from refpipe.storage.layout import env_worker_actor

COLUMNS = ("step", "reward", "tokens", "kept", "kept MiB", "step KiB", "exposed s", "dropped", "del o/t/e",
           "align err")
"""One line per trained step: ``kept`` counts chunks kept so far; ``step KiB`` the step file's size;
``exposed s`` the slowest rank's data-path seconds on the critical path (the fetch itself
runs while the previous step trains); ``dropped`` the step's dropped micro batches; ``del o/t/e``
chunks deleted so far by the orchestrator / the trainer / env workers (``+N!``: N trainer deletes failed
in this step's window and are retried: unfinished deletes); ``align err`` the max
|recomputed - inference| logprob on on-policy tokens."""
WIDTHS = (4, 6, 6, 5, 8, 8, 9, 7, 11, 9)


def _line(cells) -> str:
    return " ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS))


@dataclass(frozen=True)
class StepRow:
    """One step's line: orchestrator side when published, trainer side when trained."""

    step: int
    reward: float
    tokens: int
    kept_chunks: int
    kept_bytes: int
    step_file_bytes: int
    exposed_s: float = 0.0
    dropped: int = 0
    deletes: str = ""
    align_err: float = 0.0

    @classmethod
    def from_header(cls, header: StepHeader, step_file_bytes: int, kept_chunks: int, kept_bytes: int) -> "StepRow":
        m = header.metrics
        return cls(header.step, m["reward_mean"], int(m["num_tokens"]), kept_chunks, kept_bytes, step_file_bytes)

    def with_trainer(self, metrics: dict, deletes: tuple[int, int, int]) -> "StepRow":
        """Add the trainer's side; ``deletes`` = chunks deleted so far by orchestrator, trainer, env workers
        (then ``+N!``: N trainer deletes of this step failed and will be retried)."""
        failed = f" +{metrics['delete_failures']}!" if metrics.get("delete_failures") else ""
        return replace(self, exposed_s=metrics["exposed_data_seconds_max"], dropped=metrics["dropped_micro_batches"],
                       deletes="/".join(map(str, deletes)) + failed, align_err=metrics["on_policy_max_abs_diff"])

    def cells(self) -> list[str]:
        return [str(self.step), f"{self.reward:.3f}", str(self.tokens), str(self.kept_chunks),
                f"{self.kept_bytes / 2**20:.2f}", f"{self.step_file_bytes / 1024:.1f}", f"{self.exposed_s:.3f}",
                str(self.dropped), self.deletes, f"{self.align_err:.1e}"]


class ProgressView:
    """A progress bar over steps plus one printed line per trained step (see ``COLUMNS``)."""

    def __init__(self, console: Console, cfg) -> None:
        self.console, self.num_steps = console, cfg.job.num_steps
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = self.progress.add_task("steps", total=self.num_steps)

    def __enter__(self) -> "ProgressView":
        self.progress.start()
        self.console.print(_line(COLUMNS), highlight=False)
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def step_done(self, row: StepRow) -> None:
        self.console.print(_line(row.cells()), highlight=False)
        self.progress.advance(self.task)

    def summary(self, report: AuditReport, deletes: Counter, alignment_max: float, alignment_ok: bool,
                dead_workers: list[int], failure: str | None, resumed: dict | None = None,
                release: tuple[str, int] | None = None) -> None:
        """The audit table, every violation, and a last line that says whether the run succeeded.

        ``resumed`` (a later life): checkpoint step it resumed from, steps replayed and skipped, chunks reclaimed.
        ``release``: the release policy and the most bytes trained steps held for a checkpoint at once.
        """
        self.console.print(f"run {report.run_uri}", soft_wrap=True, highlight=False)
        table = Table(title="ledger audit", show_header=False)
        for name, value in (("kept", report.kept), ("shipped", report.shipped), ("deleted", report.deleted),
                            ("outstanding", report.outstanding), ("leaked", report.leaked),
                            ("double deletes", report.double_deletes), ("unknown deletes", report.unknown_deletes)):
            table.add_row(name, str(value))
        table.add_row("retained", str(report.retained))
        for actor, n in sorted(deletes.items()):
            table.add_row(f"deletes: {actor}", str(n))
        table.add_row("alignment max |dlogp| (on-policy)", f"{alignment_max:.2e}")
        if release:
            policy, held = release
            table.add_row(f"release {policy}", f"peak {held / 2**20:.2f} MiB held for a checkpoint"
                          if policy == "after_checkpoint" else "a resume skips steps after the last checkpoint")
        if resumed:
            start = resumed["from_checkpoint_step"]
            table.add_row("resumed from", f"checkpoint of step {start}" if start >= 0 else "the warm start")
            for key in ("replayed_steps", "skipped_steps", "reclaimed_chunks"):
                table.add_row(key.replace("_", " ") + (" from dead sessions" if key == "reclaimed_chunks" else ""),
                              str(resumed[key]))
        if dead_workers:
            table.add_row("env workers that died", ", ".join(env_worker_actor(w) for w in dead_workers))
        self.console.print(table)
        for line in report.violations:
            self.console.print(f"[red]audit: {line}")
        if not alignment_ok:
            self.console.print(f"[red]alignment check failed: max |recomputed - inference| logprob "
                               f"{alignment_max:.3e} >= tolerance")
        verdict = "[green]audit clean" if report.clean else "[red]audit FAILED"
        self.console.print(f"{verdict}; alignment {'ok' if alignment_ok else 'FAILED'}")
        if failure:
            uri = markup_safe(report.run_uri)
            self.console.print(f"[red]run FAILED: {markup_safe(failure)}. Chunks of any untrained steps are kept: "
                               f"continue the run from its newest checkpoint with `refpipe run --resume {uri}`, or, "
                               f"to end it once no process of the run is left, `refpipe sweep --stopped {uri}` "
                               "removes what no step file holds.", soft_wrap=True, highlight=False)
