"""``refpipe inspect``: what a step file holds, per DP rank and micro batch, and which chunks remain.

Read-only and torch-free, like every inspection command (``show``, ``ls``,
``verify`` live in ``cli/inspect_*.py`` and are re-exported here so
``cli/main.py`` registers all four from one module).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from refpipe.cli.inspect_common import (
    S3_ENDPOINT_HELP,
    ChunkState,
    chunk_states,
    clean_errors,
    load_step,
    open_step,
    out_console,
    refuse_inside_run,
)
from refpipe.cli.inspect_ls import ls_run
from refpipe.cli.inspect_show import show_arrays
from refpipe.cli.inspect_verify import verify_step
from refpipe.job.text import markup_safe
from refpipe.pipeline.step_header import MicroBatchRecord, StepHeader
from refpipe.storage.errors import ConfigError

__all__ = ["inspect_step", "ls_run", "show_arrays", "summarize", "verify_step"]


def field_names(array_names) -> list[str]:
    """Field names of stored array names (``sampling_mask.counts`` -> ``sampling_mask``), sorted."""
    return sorted({name.split(".")[0] for name in array_names})


def _micro_batch_summary(header: StepHeader, mb: MicroBatchRecord, states: dict[str, ChunkState]) -> dict:
    ref_ids = sorted({s.ref for s in mb.sequences if s.ref is not None})
    chunks = header.chunks([header.refs[i] for i in ref_ids])
    missing = [states[c.key].uri for c in chunks if not states[c.key].present]
    return {
        "dp_rank": mb.dp_rank, "index": mb.index,
        "num_sequences": len(mb.sequences), "num_tokens": mb.num_tokens,
        "num_padding_tokens": mb.num_padding_tokens, "has_routing": mb.has_routing,
        "num_borrowed": sum(s.borrowed for s in mb.sequences),
        "env_names": dict(Counter(s.env_name for s in mb.sequences)),
        "fields": field_names(name for i in ref_ids for name in header.refs[i].arrays),
        "num_chunks": len(chunks), "num_chunks_present": len(chunks) - len(missing),
        "num_chunks_missing": len(missing), "missing": missing,
        "num_segments": sum(len(header.refs[i].segments) for i in ref_ids),
        "sequences": [{"num_tokens": s.num_tokens, "env_name": s.env_name, "borrowed": s.borrowed,
                       "branch_id": None if s.ref is None else header.refs[s.ref].branch_id,
                       "num_segments": 0 if s.ref is None else len(header.refs[s.ref].segments)}
                      for s in mb.sequences],
    }


def summarize(header: StepHeader, step_uri: str, states: dict[str, ChunkState]) -> dict:
    """The JSON summary of a step file (``refpipe inspect --json``).

    Args:
        header: the validated step header.
        states: node key -> whether that chunk still exists (and its URI in the run as opened), for each of
            ``header.chunks()``.

    Returns:
        A dict with the step's identity, chunk counts (``header.chunks()``: a segment is a chunk, a shared prefix
        counts once), every branch with a missing chunk (its first) and the ledger's word on it, and one entry
        per micro batch (counts, env names, fields, chunks present/missing, and its sequences in packing order).
        URIs are those looked at, in the run as opened (``run_uri`` too: a copied run's header still names the
        original).
    """
    missing = []
    for ref, owner in zip(header.refs, header.owners):
        state = next((states[c.key] for c in ref.chunks if not states[c.key].present), None)
        if state is not None:
            missing.append({"uri": state.uri, "branch_id": ref.branch_id, "owner_dp_rank": owner,
                            "problem": state.problem})
    num_missing = sum(not state.present for state in states.values())
    return {
        "step_uri": step_uri, "run_uri": step_uri.rpartition("/steps/")[0], "step": header.step,
        "seq_len": header.seq_len,
        "dp_world_size": header.dp_world_size, "metrics": header.metrics,
        "num_micro_batches": len(header.micro_batches), "num_chunks": len(states),
        "num_chunks_present": len(states) - num_missing, "num_chunks_missing": num_missing,
        "missing": missing,
        "micro_batches": [_micro_batch_summary(header, mb, states) for mb in header.micro_batches],
    }


def _envs(counts: dict[str, int]) -> str:
    return ", ".join(f"{markup_safe(name)} x{n}" if n > 1 else markup_safe(name) for name, n in counts.items())


def render(summary: dict, console: Console) -> None:
    """Print the summary as one table per DP rank, then the missing chunks."""
    console.print(f"[bold]step {summary['step']}[/] of {markup_safe(summary['run_uri'])}  "
                  f"seq_len={summary['seq_len']}  dp_world_size={summary['dp_world_size']}  "
                  f"chunks: {summary['num_chunks_present']} present, {summary['num_chunks_missing']} missing",
                  highlight=False, soft_wrap=True)
    if summary["metrics"]:
        console.print("metrics: " + "  ".join(f"{markup_safe(k)}={v:g}" for k, v in summary["metrics"].items()),
                      highlight=False, soft_wrap=True)
    for dp_rank in range(summary["dp_world_size"]):
        table = Table(title=f"DP rank {dp_rank}", title_justify="left")
        for column in ("micro batch", "sequences", "tokens", "padding", "borrowed", "env names", "fields", "chunks"):
            table.add_column(column, justify="right" if column in ("sequences", "tokens", "padding") else "left")
        for mb in (m for m in summary["micro_batches"] if m["dp_rank"] == dp_rank):
            chunks = f"[green]{mb['num_chunks_present']} present[/]"
            if mb["num_chunks_missing"]:
                chunks += f", [red]{mb['num_chunks_missing']} missing[/]"
            if mb["num_segments"]:
                chunks += f" ({mb['num_segments']} segments)"
            table.add_row(str(mb["index"]), str(mb["num_sequences"]), str(mb["num_tokens"]),
                          str(mb["num_padding_tokens"]), str(mb["num_borrowed"]), _envs(mb["env_names"]),
                          markup_safe(", ".join(mb["fields"])) or "-", chunks)
        console.print(table)
    for chunk in summary["missing"]:
        console.print(f"[red]missing[/] {markup_safe(chunk['uri'])} (owner DP rank {chunk['owner_dp_rank']}): "
                      f"{markup_safe(chunk['problem'])}",
                      highlight=False, soft_wrap=True)


@clean_errors
def inspect_step(
    step_uri: Annotated[str, typer.Argument(metavar="STEP_URI",
        help="Step file: path, file:// or s3:// URI of <run>/steps/step_<N>.npz.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Also draw the micro batches into this PNG file.")] = None,
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help=S3_ENDPOINT_HELP)] = None,
) -> None:
    """Tabulate a step file per DP rank and micro batch, and check which referenced chunks still exist.

    Exit codes: 0 shown; 2 the step file is missing, unreadable, truncated or foreign, or ``--plot`` does
    not end in ``.png``.
    """
    target = open_step(step_uri, s3_endpoint_url)
    if plot and plot.suffix.lower() != ".png":
        raise ConfigError(f"--plot {str(plot)!r}: expected a file name ending in .png")
    plot_path = refuse_inside_run(target.store, str(plot), "--plot") if plot else None
    header = load_step(target).header
    chunks = header.chunks()
    states = dict(zip((c.key for c in chunks), chunk_states(target.store, chunks, header.step)))
    summary = summarize(header, target.uri, states)
    if plot_path:  # first: a reader that closes the pipe early (`| head`) ends the command at the print
        from refpipe.cli.inspect_plot import plot_micro_batches

        plot_micro_batches(summary, plot_path)
    if as_json:
        typer.echo(json.dumps(summary, indent=1))
    else:
        render(summary, out_console())
