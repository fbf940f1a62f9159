"""``refpipe audit`` and ``refpipe sweep``: prove a run's ledger invariants; clean up after a crash.

Exit codes: 0 clean; 1 the audit found a violated invariant (leaks, double or unknown
deletes, unfinished deletes, missing chunks, unreadable step files, unreadable ledger records,
and with ``--finished`` anything still outstanding); 2 the command could not run (the sweep:
also an unreadable step file or ledger record, nothing deleted).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from refpipe.cli.inspect_common import EXIT_PROBLEMS, S3_ENDPOINT_HELP, clean_errors, open_run, out_console, progress
from refpipe.job.text import markup_safe
from refpipe.pipeline.audit import AuditReport, audit
from refpipe.pipeline.sweep import SweepResult, sweep

RunArg = Annotated[str, typer.Argument(metavar="RUN_URI", help="Run: path, file:// or s3:// URI of <root>/<run_id>.")]
StoppedOpt = Annotated[bool, typer.Option(
    "--stopped", help="No process of the run is running: every ledger session counts as dead "
                      "(chunks of untrained step files are still held for a restarted trainer).")]
EndpointOpt = Annotated[Optional[str], typer.Option(help=S3_ENDPOINT_HELP)]
_SHOWN = 20
"""Chunks listed per category in the human-readable output."""


def _print_chunks(console: Console, title: str, uris: list[str]) -> None:
    if not uris:
        return
    console.print(f"[bold]{title}[/] ({len(uris)})", highlight=False)
    for uri in uris[:_SHOWN]:
        console.print(f"  {markup_safe(uri)}", highlight=False, soft_wrap=True)
    if len(uris) > _SHOWN:
        console.print(f"  ... {len(uris) - _SHOWN} more (--json lists all)", highlight=False)


def render_audit(report: AuditReport, console: Console) -> None:
    """Counts, outstanding chunks by holder, the problem lists, and the verdict."""
    console.print(f"audit of {markup_safe(report.run_uri)}", highlight=False, soft_wrap=True)
    table = Table(show_header=False)
    for name in ("kept", "shipped", "borrowed", "deleted", "retained", "present", "outstanding", "leaked",
                 "double_deletes", "unknown_deletes"):
        table.add_row(name, str(getattr(report, name)))
    for holder, count in report.outstanding_by_holder.items():
        table.add_row(f"  held by {markup_safe(holder)}", str(count))
    console.print(table)
    _print_chunks(console, "leaked", report.leaked_chunks)
    _print_chunks(console, "unfinished deletes", report.unfinished_deletes)
    _print_chunks(console, "missing without a delete record", report.missing)
    for title, lines in (("delete problems", report.delete_problems), ("unreadable step files",
                         report.unreadable_step_files), ("unreadable ledger records", report.bad_records),
                         ("stray keys (no refpipe object belongs there)", report.stray_keys)):
        _print_chunks(console, title, lines)
    for line in report.violations:
        console.print(f"[red]violation[/] {markup_safe(line)}", highlight=False)
    if report.clean:
        console.print("[green]clean[/]")


@clean_errors
def audit_run(
    run_uri: RunArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    stopped: StoppedOpt = False,
    finished: Annotated[bool, typer.Option(
        "--finished", help="The run is over (implies --stopped): chunks still outstanding are violations.")] = False,
    incremental: Annotated[bool, typer.Option(
        "--incremental", help="Read only what is new since the last incremental audit (ledger/audit/summary.json), "
                              "then rewrite that summary.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Audit as --stopped/--finished even though a session's heartbeat is live (a process "
                        "outside the run renews it under the run's actor name).")] = False,
    s3_endpoint_url: EndpointOpt = None,
) -> None:
    """Audit a run: kept, shipped, deleted, outstanding by holder, leaked, double and unknown deletes.

    Exit codes: 0 clean; 1 an invariant is violated; 2 the run could not be read, or --stopped/--finished while a
    session of the run is live by its heartbeat (unless --force).
    """
    store = open_run(run_uri, s3_endpoint_url)
    with progress("auditing") as bar:
        report = audit(store, stopped=stopped, finished=finished, incremental=incremental, confirm_stopped=not force,
                       progress=bar)
    if as_json:
        typer.echo(report.model_dump_json())
    else:
        render_audit(report, out_console())
    raise typer.Exit(EXIT_PROBLEMS if report.violations else 0)


def render_sweep(result: SweepResult, console: Console) -> None:
    """What the sweep deleted (or would delete)."""
    verb = "would delete" if result.dry_run else "deleted"
    _print_chunks(console, f"{verb}: leaked chunks", result.deleted)
    _print_chunks(console, f"{verb}: unfinished deletes", result.finished_deletes)
    _print_chunks(console, f"{verb}: incomplete keeps", result.removed_incomplete)
    _print_chunks(console, f"{verb}: retained chunks", result.retained)
    _print_chunks(console, "not deleted (a later sweep finishes them)", result.failed)
    total = len(result.deleted) + len(result.finished_deletes) + len(result.removed_incomplete) + len(result.retained)
    console.print(f"{verb} {total} chunks" + (f"; {result.conflicts} already deleted by others" if result.conflicts
                                              else "")
                  + (f"; removed {result.removed_directories} empty directories" if result.removed_directories
                     else ""), highlight=False)


@clean_errors
def sweep_run(
    run_uri: RunArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted; delete nothing.")] = False,
    stopped: StoppedOpt = False,
    abandon: Annotated[bool, typer.Option(
        "--abandon", help="The run is stopped for good: also delete the chunks of step files never trained.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Sweep as --stopped/--abandon even though a session's heartbeat is live (a process "
                        "outside the run renews it under the run's actor name).")] = False,
    retained: Annotated[bool, typer.Option(
        "--retained", help="Also delete the chunks kept for inspection (trainer.retain_steps).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of lists.")] = False,
    s3_endpoint_url: EndpointOpt = None,
) -> None:
    """Delete, exactly once and recorded (ledger actor ``sweep``), the chunks no live holder accounts for.

    Never touches a chunk of a step file not yet trained, unless ``--abandon`` (implies
    ``--stopped``). ``--retained`` also deletes the chunks retained for inspection
    (``trainer.retain_steps``). ``--stopped`` is checked by the sessions' heartbeats: while a session of the
    run is live, on any host, the sweep refuses, naming it (unless ``--force``). Never deletes a chunk of a
    step a resume replays (``release = "after_checkpoint"``: after the newest checkpoint), unless ``--abandon``.
    Exit codes: 0 swept; 1 some chunks could not be deleted (listed; a later sweep finishes them); 2 the run could
    not be read, a step file or a ledger record is unreadable, or the run
    still runs here (nothing deleted).
    """
    store = open_run(run_uri, s3_endpoint_url)
    with progress("sweeping") as bar:
        result = sweep(store, stopped=stopped, dry_run=dry_run, abandon=abandon, force=force, retained=retained,
                       progress=bar)
    if as_json:
        typer.echo(result.model_dump_json())
    else:
        render_sweep(result, out_console())
    raise typer.Exit(EXIT_PROBLEMS if result.failed else 0)
