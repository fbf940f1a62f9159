"""Plumbing shared by the offline inspection commands (``inspect``, ``show``, ``ls``, ``verify``).

Turns a step or run URI from the command line into a read-only view of the run
(the run's store plus the key of the step file), loads step files through the
step-file schema, checks which referenced chunks still exist, and turns every
expected failure into one line on stderr and a non-zero exit (no traceback).
None of these helpers writes under the run prefix or imports torch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from refpipe.job.text import printable
from refpipe.pipeline.step_file import StepFile, locate_step_file
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.config import run_storage
from refpipe.storage.errors import ConfigError, DeleteRecordError, RefpipeError
from refpipe.storage.layout import chunk_keys, step_key
from refpipe.storage.ledger_records import delete_record_of
from refpipe.storage.store import Store

T = TypeVar("T")
R = TypeVar("R")
EXIT_PROBLEMS = 1
"""Exit code when the command ran but found problems (``verify``)."""
EXIT_ERROR = 2
"""Exit code when the command could not run (missing, unreadable or foreign input)."""
S3_ENDPOINT_HELP = "S3 endpoint URL (MinIO, Ceph RGW, moto); default: AWS_ENDPOINT_URL or AWS."

err_console = Console(stderr=True)
PIPED_WIDTH = 400
"""Columns a command's tables may take when stdout is not a terminal and ``COLUMNS`` is unset (rich assumes 80)."""


def out_console() -> Console:
    """The console a command prints its report on: stdout. Piped into a file, ``less`` or a job log (not a
    terminal, no ``COLUMNS``), tables take the width their cells need, up to ``PIPED_WIDTH`` columns, instead of
    rich's 80, so no URI or env name is cut."""
    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=PIPED_WIDTH)


def _click_exceptions(name: str) -> tuple[type[Exception], ...]:
    """``click.<name>`` and, since typer 0.2x vendors its own click, ``typer._click.exceptions.<name>`` (what typer
    raises there)."""
    found = [getattr(click, name)]
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        return tuple(found)
    return (*found, getattr(vendored, name))


USAGE_ERRORS = _click_exceptions("UsageError")
"""What a command line that does not parse raises (missing or unknown argument, option or command, a bad value)."""
CLICK_EXCEPTIONS = _click_exceptions("ClickException")
_PASSED_THROUGH: tuple[type[BaseException], ...] = (typer.Exit, typer.Abort, BrokenPipeError, *CLICK_EXCEPTIONS)
"""What a command's own errors handler lets through to typer."""


def fail(message: str, code: int = EXIT_ERROR) -> None:
    """Print ``error: <message>`` as one line on stderr and exit with ``code``."""
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(code)


def one_line(message: str) -> str:
    """``message`` with its line breaks folded into ``; `` (pydantic errors span lines) and every other
    control character shown as its escape (``job.text.printable``)."""
    return printable("; ".join(part.strip() for part in str(message).splitlines() if part.strip()))


def clean_errors(command: Callable[..., T]) -> Callable[..., T]:
    """Wrap a command so every error ends it with one line on stderr and exit code 2, never a traceback.

    Refpipe and OS errors (missing, unreadable, no permission) print their message; anything else
    (an S3 client's ``EndpointConnectionError`` for an unreachable endpoint, a bug) prints its type
    and message. Exits the command requested itself (``typer.Exit``) pass through, and so does a
    ``BrokenPipeError``: the reader closed the pipe (``refpipe show ... | head``), and typer's main
    ends the command quietly, as Unix tools end (exit code 1, nothing on stderr).
    """

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except _PASSED_THROUGH:
            raise
        except RefpipeError as e:
            fail(str(e) or type(e).__name__)
        except OSError as e:  # from a listing: "permission denied: /runs/run_0/steps"
            fail(f"{e.strerror.lower()}: {e.filename}" if e.strerror and e.filename else str(e) or type(e).__name__)
        except Exception as e:  # noqa: BLE001 -- the documented boundary: no traceback from any command
            fail(f"{type(e).__name__}: {e}")

    return wrapper


def open_run(run_uri: str, s3_endpoint_url: str | None) -> Store:
    """The store of the run at ``run_uri`` (``/abs/root/run_0``, ``file://...``, ``s3://b/p/run_0``).

    Raises:
        ConfigError: not ``<root>/<run_id>`` or an unknown scheme (``storage.config.run_storage``).
    """
    return open_store(run_storage(run_uri, s3_endpoint_url))


@dataclass(frozen=True)
class StepTarget:
    """A step file named on the command line: its run's store, its key and its step number."""

    store: Store
    key: str
    step: int

    @property
    def uri(self) -> str:
        return self.store.uri(self.key)


def open_step(step_uri: str, s3_endpoint_url: str | None) -> StepTarget:
    """Parse ``<root>/<run_id>/steps/step_<N>.npz`` into the run's store and the file's key
    (``pipeline.step_file.locate_step_file``).

    Raises:
        ConfigError: the URI does not name a step file under a run's ``steps/``.
    """
    store, step = locate_step_file(step_uri, s3_endpoint_url)
    return StepTarget(store, step_key(step), step)


def load_step(target: StepTarget) -> StepFile:
    """Read and validate the step file.

    Raises:
        KeyNotFoundError: no such file.
        StepFileError: truncated, foreign, another run, a ref outside the run, or a header whose step
            is not the one in the file name.
        PermissionError: the file cannot be read.
    """
    return StepFile.read(target.store, target.step)


def progress(description: str) -> Progress:
    """A transient progress bar on stderr (drawn only on a terminal)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True, disable=not err_console.is_terminal)


def parallel_map(store: Store, fn: Callable[[T], R], items: Sequence[T], description: str) -> list[R]:
    """``[fn(x) for x in items]`` on ``store.config.max_concurrent_scan_ops`` threads, with a progress bar."""
    if not items:
        return []
    with progress(description) as bar:
        task = bar.add_task(description, total=len(items))
        return bounded_map(fn, items, store.config.max_concurrent_scan_ops, on_result=lambda _: bar.advance(task))


@dataclass(frozen=True)
class ChunkState:
    """Whether a referenced chunk is still under the run prefix, and if not, what the ledger says."""

    uri: str
    """The chunk looked at: its URI in the run as opened (``PayloadRef.key``), not where its writer saw it."""
    present: bool
    problem: str = ""
    """Empty when present; else ``deleted by <holder> (<reason>)``, ``missing (no delete record)`` or
    ``incomplete: <c.0 or zarr.json> missing (no delete record)``."""


def chunk_state(store: Store, ref: PayloadRef, step: int | None = None) -> ChunkState:
    """Check that the ref's data object (``c.0``) and commit marker (``zarr.json``) both exist and, when
    either is gone, its delete record (``deleted_by``; ``step``: the step file naming the ref). A segmented branch
    (``PayloadRef.segments``): the state of its first segment that is not present (named by the segment's URI),
    else present.

    Raises:
        OutsideRunError: the ref lies outside the run (``StepFile`` already refuses such step files).
    """
    if ref.segments:  # a segmented branch is present when every object is; else its first missing one
        states = [chunk_state(store, s) for s in ref.chunks]
        return next((s for s in states if not s.present), ChunkState(store.uri(ref.key), True))
    gone = [key.rpartition("/")[2] for key in chunk_keys(ref.key) if not store.exists(key)]
    if not gone:
        return ChunkState(store.uri(ref.key), True)
    why = "missing" if len(gone) == 2 else f"incomplete: {gone[0]} missing"
    return ChunkState(store.uri(ref.key), False, deleted_by(store, ref, step) or f"{why} (no delete record)")


def deleted_by(store: Store, ref: PayloadRef, step: int | None = None) -> str | None:
    """``deleted by <holder> (<reason>)`` from the chunk's delete record (``storage.ledger_records.delete_record_of``;
    ``step``: the step file naming the ref, whose release records are read too), ``deleted (delete record <uri> is
    unreadable: ...)``, or None without one; a segmented branch: ``segment <id> deleted by ...`` of its first
    segment with a delete record."""
    for segment in ref.segments:
        if (why := deleted_by(store, segment, step)) is not None:
            return f"segment {segment.branch_id} {why}"
    record = delete_record_of(store, ref.branch_id, step)
    if record is None:
        return None
    if isinstance(record, DeleteRecordError):
        return f"deleted ({record})"
    return f"deleted by {record.holder} ({record.reason})"


def chunk_states(store: Store, refs: Iterable[PayloadRef], step: int | None = None) -> list[ChunkState]:
    """``chunk_state`` of every ref (of step file ``step``), in order, checked in parallel."""
    return parallel_map(store, lambda ref: chunk_state(store, ref, step), list(refs), "checking chunks")


def refuse_inside_run(store: Store, local_path: str, what: str) -> str:
    """Return ``local_path`` made absolute, refusing URIs and paths under a local run prefix.

    Raises:
        ConfigError: ``local_path`` is a URI or lies inside the run prefix.
    """
    if "://" in local_path:
        raise ConfigError(f"{what} {local_path!r}: expected a local path")
    path = os.path.realpath(local_path)
    run_path = os.path.realpath(store.prefix.path)
    if store.prefix.scheme == "file" and (path == run_path or path.startswith(run_path + "/")):
        raise ConfigError(f"{what} {local_path!r} is inside run {store.prefix.uri}: inspection never writes there")
    return path
