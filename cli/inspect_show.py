"""``refpipe show``: one micro batch's arrays exactly as a trainer rank assembles them.

Fetches the chunks of the micro batch's sequences and calls the trainer's own
numpy-only ``trainer.assemble.assemble_micro_batch``, so what is shown (and
written with ``--npy``) is byte for byte what the trainer builds before turning
it into tensors. Array names:

- ``cu_seqlens`` int32 and every token stream (``input_ids``, ``loss_mask``, ...) ``[seq_len]``;
- per field ``<field>.values``, ``<field>.cu_seqlens``, and as the layout has them
  ``<field>.counts`` (ragged), ``<field>.padded`` (token domain), ``<field>.row_ids``
  (completion domain).

The run's ``FieldsConfig`` (trailing shapes, and ``num_experts``, which decides the
routing rows of padding tokens in ``routed_experts.padded``) is the step header's
``fields``: the step file needs no other config.
"""

from __future__ import annotations

import os
import shutil
from typing import Annotated, Optional

import numpy as np
import typer

from refpipe.cli.inspect_common import (
    S3_ENDPOINT_HELP,
    clean_errors,
    deleted_by,
    load_step,
    open_step,
    parallel_map,
    refuse_inside_run,
)
from refpipe.job.text import printable
from refpipe.pipeline.step_header import MicroBatchRecord, StepHeader
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import ChunkNotFoundError, ConfigError, RefError
from refpipe.storage.store import Store
from refpipe.trainer.assemble import AssembledMicroBatch, assemble_micro_batch
from refpipe.trainer.layout import pad_streams, padded_cu_seqlens


def _micro_batch(header: StepHeader, dp_rank: int, index: int) -> MicroBatchRecord:
    mbs = header.micro_batches_of(dp_rank) if 0 <= dp_rank < header.dp_world_size else []
    if not 0 <= index < len(mbs):
        raise ConfigError(f"--dp-rank {dp_rank} --micro-batch {index}: step {header.step} has DP ranks "
                          f"0..{header.dp_world_size - 1} with {len(header.micro_batches) // header.dp_world_size} "
                          "micro batches each")
    return mbs[index]


def _fetch(store: Store, header: StepHeader, mb: MicroBatchRecord) -> tuple[dict[int, dict[str, np.ndarray]],
                                                                             dict[int, str]]:
    """``(ref index -> its arrays cut to the most tokens any sequence of mb keeps of it, ref index -> why its chunk is
    gone)``: a chunk that does not exist is gone (``deleted by <holder> (<reason>)`` or ``no delete record``).

    Raises:
        RefError: a sequence of ``mb`` keeps more tokens than its ref holds, or a ref's rows disagree with its
            token counts (``StepHeader.micro_batch_problem``).
    """
    problem = header.micro_batch_problem(mb)
    if problem:
        raise RefError(f"{problem}; a trainer drops this micro batch")
    keep: dict[int, int] = {}
    for seq in mb.sequences:
        if seq.ref is not None:
            keep[seq.ref] = max(keep.get(seq.ref, 0), seq.num_tokens)

    def one(i: int) -> dict[str, np.ndarray] | str:
        try:
            return fetch_arrays(store, header.refs[i], keep[i])
        except ChunkNotFoundError:
            return deleted_by(store, header.refs[i], header.step) or "no delete record"

    fetched = dict(zip(keep, parallel_map(store, one, list(keep), "fetching chunks")))
    return ({i: got for i, got in fetched.items() if not isinstance(got, str)},
            {i: got for i, got in fetched.items() if isinstance(got, str)})


def gone_lines(store: Store, header: StepHeader, mb: MicroBatchRecord, gone: dict[int, str],
               sequence: int | None) -> list[tuple[set[str], str]]:
    """One ``(its fields, "<fields> of sequence <j, ...>: chunk <uri>: <why>")`` per gone chunk, in the order of
    its first sequence; with ``sequence``, only the chunk of that sequence."""
    out = []
    for i, why in gone.items():
        seqs = [j for j, seq in enumerate(mb.sequences) if seq.ref == i]
        if sequence is not None and sequence not in seqs:
            continue
        fields = sorted({name.split(".")[0] for name in header.refs[i].arrays})
        line = (f"{', '.join(fields)} of sequence {', '.join(map(str, seqs))}: chunk {store.uri(header.refs[i].key)}: "
                f"{why}")
        out.append((set(fields), line))
    return out


def named_arrays(batch: AssembledMicroBatch) -> dict[str, np.ndarray]:
    """The assembled micro batch as flat ``name -> array`` (names in the module docstring)."""
    out = {"cu_seqlens": batch.cu_seqlens, **batch.streams}
    for name, f in batch.fields.items():
        parts = {"values": f.values, "cu_seqlens": f.cu_seqlens, "counts": f.counts, "padded": f.padded,
                 "row_ids": f.row_ids}
        out.update({f"{name}.{part}": a for part, a in parts.items() if a is not None})
    return out


def cut_sequence(arrays: dict[str, np.ndarray], mb: MicroBatchRecord, j: int) -> dict[str, np.ndarray]:
    """The rows of sequence ``j`` only; ``cu_seqlens`` become ``[0, rows]`` and ``row_ids`` index the cut values.

    Raises:
        ConfigError: ``j`` is not a sequence of ``mb``.
    """
    if not 0 <= j < len(mb.sequences):
        raise ConfigError(f"--sequence {j}: micro batch dp_rank={mb.dp_rank} index={mb.index} has sequences "
                          f"0..{len(mb.sequences) - 1}")
    start, end = (int(x) for x in mb.cu_seqlens()[j: j + 2])
    out = {}
    for name, a in arrays.items():
        field, _, part = name.rpartition(".")
        if name == "cu_seqlens":
            out[name] = np.array([0, end - start], np.int32)
            continue
        if not field or part == "padded":
            out[name] = a[start:end]
            continue
        lo, hi = (int(x) for x in arrays[f"{field}.cu_seqlens"][j: j + 2])
        if part == "cu_seqlens":
            out[name] = np.array([0, hi - lo], np.int32)
        elif part == "row_ids":
            out[name] = np.where(a[start:end] >= 0, a[start:end] - lo, -1)
        elif part == "values" and f"{field}.counts" in arrays:
            offsets = np.concatenate([[0], np.cumsum(arrays[f"{field}.counts"], dtype=np.int64)])
            out[name] = a[offsets[lo]: offsets[hi]]
        else:
            out[name] = a[lo:hi]
    return out


def _select(arrays: dict[str, np.ndarray], field: str, gone: list[tuple[set[str], str]]) -> dict[str, np.ndarray]:
    chosen = {name: a for name, a in arrays.items() if name == field or name.startswith(field + ".")}
    gone_here = [line for fields, line in gone if field in fields]
    if gone_here:
        raise ConfigError(f"--field {field!r} is gone: {'; '.join(gone_here)}")
    if not chosen:
        names = sorted({name.split(".")[0] for name in arrays})
        raise ConfigError(f"--field {field!r}: expected one of {names}")
    return chosen


def _print(arrays: dict[str, np.ndarray]) -> None:
    with np.printoptions(threshold=200, edgeitems=4, linewidth=max(60, shutil.get_terminal_size().columns)):
        for name, a in arrays.items():
            typer.echo(f"{name}  {a.dtype.str} {list(a.shape)}\n{np.array2string(a)}")


def _write_npy(arrays: dict[str, np.ndarray], directory: str, stem: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, a in arrays.items():
        paths.append(os.path.join(directory, f"{stem}.{name}.npy"))
        np.save(paths[-1], a, allow_pickle=False)
    return paths


@clean_errors
def show_arrays(
    step_uri: Annotated[str, typer.Argument(metavar="STEP_URI",
        help="Step file: path, file:// or s3:// URI of <run>/steps/step_<N>.npz.")],
    micro_batch: Annotated[int, typer.Option("--micro-batch", help="Micro batch index within the DP rank.")],
    dp_rank: Annotated[int, typer.Option(help="DP rank whose micro batch to show.")] = 0,
    sequence: Annotated[Optional[int], typer.Option(help="Only this sequence of the micro batch.")] = None,
    field: Annotated[Optional[str], typer.Option(
        help="Only this field or stream (e.g. routed_experts, input_ids).")] = None,
    npy: Annotated[Optional[str], typer.Option(help="Write one .npy per array into this local directory.")] = None,
    s3_endpoint_url: Annotated[Optional[str], typer.Option(help=S3_ENDPOINT_HELP)] = None,
) -> None:
    """Print (or save) one micro batch's arrays exactly as the trainer assembles them.

    When chunks of the micro batch are gone (deleted, or missing), one ``gone:`` line per gone chunk (with
    ``--sequence``, that sequence's chunk only) names its fields, sequences and why, and only the step file's own
    arrays are shown (``cu_seqlens`` and the token streams, padded as the trainer pads them; a trainer drops such a
    micro batch).

    Exit codes: 0 shown; 2 the step file is missing or unreadable, a chunk is corrupt, the micro batch's refs
    cannot be used, ``--field`` names a gone field, or a bad selection.
    """
    target = open_step(step_uri, s3_endpoint_url)
    npy_dir = refuse_inside_run(target.store, npy, "--npy") if npy else None
    step = load_step(target)
    header = step.header
    mb = _micro_batch(header, dp_rank, micro_batch)
    fetched, gone = _fetch(target.store, header, mb)
    streams = step.streams(dp_rank, micro_batch)
    if gone:
        arrays = {"cu_seqlens": padded_cu_seqlens(mb, header.seq_len), **pad_streams(streams, header.seq_len)}
    else:
        arrays = named_arrays(assemble_micro_batch(mb, streams, fetched, header.refs, seq_len=header.seq_len,
                                                   fields=header.fields))
    if sequence is not None:
        arrays = cut_sequence(arrays, mb, sequence)
    gone_chunks = gone_lines(target.store, header, mb, gone, sequence)
    if field:
        arrays = _select(arrays, field, gone_chunks)
    typer.echo(f"step {header.step}, DP rank {dp_rank}, micro batch {micro_batch}: {len(mb.sequences)} sequences, "
               f"{mb.num_tokens} tokens + {mb.num_padding_tokens} padding (seq_len {header.seq_len})"
               + ("" if sequence is None else f"; sequence {sequence}"))
    for _, line in gone_chunks:
        typer.echo(printable(f"gone: {line}"))
    if gone:
        typer.echo("shown: the step file's own arrays (cu_seqlens, token streams); a trainer drops this micro batch")
    if npy_dir:
        stem = f"step{header.step:08d}.dp{dp_rank}.mb{micro_batch}" + ("" if sequence is None else f".seq{sequence}")
        for path in _write_npy(arrays, npy_dir, stem):
            typer.echo(path)
    else:
        _print(arrays)
