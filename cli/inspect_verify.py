"""``refpipe verify``: read every chunk a step file references and check it against its reference.

For each ref: its chunk exists in the run as opened (``PayloadRef.key``), the whole chunk has the
ref's length and crc32c (``storage.chunk_read.fetch_arrays`` with ``num_tokens=None``),
the decoded arrays have the ref's dtypes and shapes, and the chunk's
``zarr.json`` field table agrees with the ref (its ``block_rows`` by
``storage.chunk_ref.check_block_rows``). Every stream member of the step file is checked too (its crc32c
against the header's ``stream_crc32c``, its dtype and shape), and every micro batch a trainer would drop
for its refs is named. One line per problem on stdout, then a one-line summary; exit code 1 if any problem.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from refpipe.cli.inspect_common import (
    EXIT_PROBLEMS,
    S3_ENDPOINT_HELP,
    clean_errors,
    deleted_by,
    open_step,
    parallel_map,
)
from refpipe.job.text import printable
from refpipe.pipeline.step_file import StepFile, check_step
from refpipe.storage.chunk_codec import read_attributes
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef, check_block_rows
from refpipe.storage.errors import ChunkCorruptError, KeyNotFoundError
from refpipe.storage.layout import chunk_keys
from refpipe.storage.store import Store


def _step_problems(step: StepFile) -> list[str]:
    """Every damaged stream member (its crc32c, ``.npy`` header or size), then every micro batch a trainer would
    drop for its refs (``StepHeader.micro_batch_problem``)."""
    problems = [f"corrupt step file: {damage}" for damage in step.damaged.values()]
    for mb in step.header.micro_batches:
        problem = step.header.micro_batch_problem(mb)
        if problem:
            problems.append(f"unusable micro batch (a trainer drops it): {problem}")
    return problems


def _metadata_problems(store: Store, ref: PayloadRef, meta_key: str) -> list[str]:
    """Compare the chunk's ``zarr.json`` field table and token counts with the ref."""
    uri = store.uri(ref.key)
    try:
        attrs = read_attributes(store.get(meta_key))
        if ref.offset is not None:
            return _object_problems(ref, attrs, uri)
        stored = {name: (a["dtype"], tuple(a["shape"]), a["domain"], a["offset"])
                  for name, a in attrs["arrays"].items()}
    except KeyError as e:
        return [f"corrupt {uri}: zarr.json unreadable: no key {e}"]
    except (ValueError, TypeError, AttributeError) as e:
        return [f"corrupt {uri}: zarr.json unreadable: {e}"]
    expected = {lay.name: (lay.dtype.str, lay.shape, lay.domain, lay.offset) for lay in ref.layout()}
    problems = [f"mismatch {uri}: array {name} is {stored.get(name)} (dtype, shape, domain, offset) in "
                f"zarr.json, {want} in the reference" for name, want in expected.items() if stored.get(name) != want]
    problems += [f"mismatch {uri}: zarr.json has array {name} the reference does not list"
                 for name in stored.keys() - expected.keys()]
    try:
        check_block_rows(attrs.get("block_rows"), "zarr.json")
    except ValueError as e:
        problems.append(f"corrupt {uri}: {e}")
    for key in ("branch_id", "num_prompt_tokens", "num_completion_tokens"):
        if attrs.get(key) != getattr(ref, key):
            problems.append(f"mismatch {uri}: {key} is {attrs.get(key)!r} in zarr.json, "
                            f"{getattr(ref, key)!r} in the reference")
    return problems


def _object_problems(ref: PayloadRef, attrs: dict[str, Any], uri: str) -> list[str]:
    """Compare a writer life's object's ``zarr.json`` (``chunk_codec.segments_metadata``) with a segment in it."""
    nbytes = attrs.get("nbytes")
    if attrs.get("format") != "refpipe.segments" or attrs.get("branch_id") != ref.branch_id:
        return [f"mismatch {uri}: zarr.json describes {attrs.get('format')!r} {attrs.get('branch_id')!r}, the "
                f"reference a segment of object {ref.branch_id!r} at offset {ref.offset}"]
    if not isinstance(nbytes, int) or nbytes < (ref.offset or 0) + ref.nbytes:
        return [f"mismatch {uri}: zarr.json says {nbytes!r} bytes, the reference a segment at bytes [{ref.offset}, "
                f"{(ref.offset or 0) + ref.nbytes})"]
    return []


def verify_chunk(store: Store, ref: PayloadRef, step: int | None = None) -> list[str]:
    """Problems of one referenced chunk (of step file ``step``), one line each (empty: the chunk is intact), naming it
    by its URI in the run as opened."""
    uri = store.uri(ref.key)
    try:
        _, meta_key = chunk_keys(ref.key)
        arrays = fetch_arrays(store, ref, None)
        problems = _metadata_problems(store, ref, meta_key)
    except KeyNotFoundError:
        return [f"missing {uri}: {deleted_by(store, ref, step) or 'no delete record'}"]
    except (ChunkCorruptError, ValueError, KeyError) as e:
        return [f"corrupt {uri}: {e}"]
    for name, spec in ref.arrays.items():
        a = arrays[name]
        if a.dtype.str != spec.dtype or a.shape != tuple(spec.shape):
            problems.append(f"mismatch {uri}: array {name} decoded as {a.dtype.str} {list(a.shape)}, "
                            f"reference says {spec.dtype} {list(spec.shape)}")
    return problems


@clean_errors
def verify_step(
    step_uri: Annotated[str, typer.Argument(metavar="STEP_URI",
        help="Step file: path, file:// or s3:// URI of <run>/steps/step_<N>.npz.")],
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help=S3_ENDPOINT_HELP)] = None,
) -> None:
    """Read every chunk the step file references; check checksum, dtype and shape against each reference.

    Prints one line per problem (missing, corrupt, mismatch, corrupt step file, unusable micro batch), then a
    summary.
    Exit codes: 0 all intact; 1 problems found; 2 the step file cannot be read at all.
    """
    target = open_step(step_uri, s3_endpoint_url)
    step = StepFile.parse(target.store.get(target.key), target.uri)
    check_step(step.header, target.step, target.uri)
    chunks = step.header.chunks()  # the one count: each object once (a writer life's segments share one)
    refs = list({(s.key, s.offset): s for ref in step.header.refs for s in ref.segments or (ref,)}.values())
    problems = _step_problems(step)
    for chunk_problems in parallel_map(target.store, lambda ref: verify_chunk(target.store, ref, target.step), refs,
                                       "verifying chunks"):
        problems += chunk_problems
    for line in problems:
        typer.echo(printable(line))
    nbytes = sum(ref.nbytes for ref in refs)
    found = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}" if problems else "all intact"
    typer.echo(f"step {step.header.step}: {len(chunks)} chunks ({nbytes} bytes), "
               f"{len(step.header.micro_batches)} micro batches: {found}")
    if problems:
        raise typer.Exit(EXIT_PROBLEMS)
