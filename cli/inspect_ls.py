"""``refpipe ls``: one screen about a run prefix: steps, chunks and bytes per writer, ledger status.

Lists the prefix (one listing per shard directory, in parallel, with a progress
bar) and reads no chunk. Each step file's last bytes are read (one ranged read of
``pipeline.step_zip.TAIL_NBYTES``) to name the truncated ones as damaged. A chunk's writer comes from its branch id
(``<actor>-<32 hex>``, what ``Keeper`` draws); only chunks with other ids have
their ``zarr.json`` read for the ``writer`` attribute (an unreadable one is
listed as corrupt, and the listing goes on). The ledger part counts
delete records, suspended open branches (``storage.ledger_open``) and, per actor, event segments and sessions,
reading the last segment of each session to see whether it ended with a clean ``close``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.filesize import decimal
from rich.table import Table

from refpipe.cli.inspect_common import (
    S3_ENDPOINT_HELP,
    clean_errors,
    fail,
    open_run,
    out_console,
    parallel_map,
    progress,
)
from refpipe.job.text import markup_safe
from refpipe.pipeline.step_zip import TAIL_NBYTES, damage_from_tail
from refpipe.storage.chunk_codec import read_writer
from refpipe.storage.layout import (
    DATA_NAME,
    DELETES_PREFIX,
    EVENTS_PREFIX,
    META_NAME,
    PAYLOADS_PREFIX,
    STEPS_PREFIX,
    branch_id_of,
    drawn_writer,
    meta_key,
    parse_payload_key,
    parse_segment_key,
    parse_step_key,
    session_opened_ms,
)
from refpipe.storage.ledger_open import OPEN_PREFIX
from refpipe.storage.ledger_records import read_segment
from refpipe.storage.store import Store

_TEMP_MARK = ".tmp-"
CORRUPT_WRITER = "(corrupt zarr.json)"
"""Writer shown for a chunk whose ``zarr.json`` had to be read and is not valid JSON attributes."""


def _sized_listing(store: Store, key_prefix: str, description: str) -> dict[str, int]:
    """``store.list_sizes(key_prefix)`` under a progress indicator."""
    with progress(description) as bar:
        bar.add_task(description, total=None)
        return store.list_sizes(key_prefix)


def _steps(store: Store, listing: dict[str, int]) -> dict:
    """Step counts and bytes, and ``damaged``: step file URI -> what its last bytes say is wrong (truncated)."""
    keys = sorted(key for key in listing if parse_step_key(key) is not None)
    steps = [parse_step_key(key) for key in keys]
    damage = parallel_map(store, lambda key: damage_from_tail(
        store.get(key, max(0, listing[key] - TAIL_NBYTES), listing[key]), listing[key]), keys, "checking step files")
    return {"num_steps": len(steps), "first": steps[0] if steps else None, "latest": steps[-1] if steps else None,
            "nbytes": sum(listing.values()),
            "damaged": {store.uri(key): problem for key, problem in zip(keys, damage) if problem}}


def _writer_of(store: Store, node: str) -> str:
    """The ``writer`` attribute of the node's ``zarr.json``; ``CORRUPT_WRITER`` if that is unreadable."""
    writer = read_writer(store.get(meta_key(node)))
    return CORRUPT_WRITER if writer is None else writer or "(unnamed)"


def _chunks(store: Store, listing: dict[str, int]) -> dict:
    """Group ``payloads/<shard>/<branch_id>/<object>`` keys into branches and writers."""
    nodes: dict[str, dict[str, int]] = defaultdict(dict)
    temp_files = 0
    for key, size in listing.items():
        if _TEMP_MARK in key.rpartition("/")[2]:
            temp_files += 1
        else:
            node, name = parsed[::2] if (parsed := parse_payload_key(key)) else key.rpartition("/")[::2]
            nodes[node][name] = size
    committed = sorted(n for n, objects in nodes.items() if {DATA_NAME, META_NAME} <= objects.keys())
    writers = {n: w for n in committed if (w := drawn_writer(branch_id_of(n)))}
    unnamed = [n for n in committed if n not in writers]
    writers.update(zip(unnamed, parallel_map(store, lambda n: _writer_of(store, n), unnamed, "reading writers")))
    per_writer: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for node in committed:
        per_writer[writers[node]][0] += 1
        per_writer[writers[node]][1] += sum(nodes[node].values())
    return {"num_chunks": len(committed), "nbytes": sum(listing.values()),
            "num_incomplete": len(nodes) - len(committed), "num_temp_files": temp_files,
            "corrupt": [store.uri(meta_key(n)) for n in unnamed if writers[n] == CORRUPT_WRITER],
            "writers": {w: {"num_chunks": c, "nbytes": b} for w, (c, b) in sorted(per_writer.items())}}


def _session_closed(store: Store, last_segment: str) -> bool:
    """Whether the session's last segment holds its ``close`` event (bad records are skipped, as the audit does)."""
    records = read_segment(store.get(last_segment))
    return any(isinstance(event, dict) and event["event"] == "close" for _, event in records)


def _ledger(store: Store, deletes: dict[str, int], events: dict[str, int], suspended: dict[str, int]) -> dict:
    last_segment: dict[tuple[str, str], tuple[int, str]] = {}
    segments: Counter[str] = Counter()
    for key in events:
        parsed = parse_segment_key(key)
        if parsed:
            actor, session, seq = parsed
            segments[actor] += 1
            last_segment[actor, session] = max(last_segment.get((actor, session), (-1, "")), (seq, key))
    sessions = sorted(last_segment, key=lambda s: (s[0], session_opened_ms(s[1])))
    closed = parallel_map(store, lambda s: _session_closed(store, last_segment[s][1]), sessions, "reading ledger")
    actors = {actor: {"num_segments": n, "num_sessions": 0, "num_closed": 0} for actor, n in sorted(segments.items())}
    for (actor, _), is_closed in zip(sessions, closed):
        actors[actor]["num_sessions"] += 1
        actors[actor]["num_closed"] += int(is_closed)
    return {"num_delete_records": sum(k.endswith(".json") for k in deletes), "actors": actors,
            "num_suspended_branches": sum(k.endswith(".json") for k in suspended)}


def run_summary(store: Store) -> dict:
    """Everything ``refpipe ls`` shows, as a dict (``--json``)."""
    steps = _sized_listing(store, STEPS_PREFIX, "listing steps")
    payloads = _sized_listing(store, PAYLOADS_PREFIX, "listing chunks")
    deletes = _sized_listing(store, DELETES_PREFIX, "listing delete records")
    events = _sized_listing(store, EVENTS_PREFIX, "listing ledger events")
    suspended = _sized_listing(store, OPEN_PREFIX, "listing suspended branches")
    return {"run_uri": store.prefix.uri, "steps": _steps(store, steps), "chunks": _chunks(store, payloads),
            "ledger": _ledger(store, deletes, events, suspended),
            "empty": not (steps or payloads or deletes or events)}


def render(summary: dict, console: Console) -> None:
    """Print the run summary: steps, chunks per writer, ledger per actor."""
    steps, chunks, ledger = summary["steps"], summary["chunks"], summary["ledger"]
    console.print(f"[bold]run[/] {summary['run_uri']}", highlight=False, soft_wrap=True)
    span = f" (first {steps['first']}, latest {steps['latest']})" if steps["num_steps"] else ""
    console.print(f"steps: {steps['num_steps']}{span}, {decimal(steps['nbytes'])}", highlight=False, soft_wrap=True)
    for uri, problem in steps["damaged"].items():
        console.print(f"[yellow]damaged step file ({markup_safe(problem)}):[/] {markup_safe(uri)}", highlight=False,
                      soft_wrap=True)
    console.print(f"chunks: {chunks['num_chunks']}, {decimal(chunks['nbytes'])}; "
                  f"{chunks['num_incomplete']} incomplete, {chunks['num_temp_files']} temp files",
                  highlight=False, soft_wrap=True)
    writers = Table("writer", "chunks", "bytes")
    for writer, w in chunks["writers"].items():
        writers.add_row(writer, str(w["num_chunks"]), decimal(w["nbytes"]))
    console.print(writers)
    for uri in chunks["corrupt"]:
        console.print(f"[yellow]corrupt zarr.json (writer unknown):[/] {uri}", highlight=False, soft_wrap=True)
    console.print(f"ledger: {ledger['num_delete_records']} delete records, {ledger['num_suspended_branches']} "
                  f"suspended open branches", highlight=False, soft_wrap=True)
    actors = Table("actor", "event segments", "sessions", "closed cleanly")
    for actor, a in ledger["actors"].items():
        closed = f"{a['num_closed']}/{a['num_sessions']}"
        actors.add_row(actor, str(a["num_segments"]), str(a["num_sessions"]),
                       closed if a["num_closed"] == a["num_sessions"] else f"[yellow]{closed}[/]")
    console.print(actors)


@clean_errors
def ls_run(
    run_uri: Annotated[str, typer.Argument(metavar="RUN_URI",
        help="Run prefix: path, file:// or s3:// URI of <root>/<run_id>.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help=S3_ENDPOINT_HELP)] = None,
) -> None:
    """Summarise a run prefix: steps, chunks and bytes per writer, ledger status.

    Exit codes: 0 shown; 2 nothing under the prefix, or it cannot be listed.
    """
    store = open_run(run_uri, s3_endpoint_url)
    summary = run_summary(store)
    if summary.pop("empty"):
        fail(f"run {store.prefix.uri}: nothing under the run prefix (wrong URI or endpoint?)")
    if as_json:
        typer.echo(json.dumps(summary, indent=1))
    else:
        render(summary, out_console())
