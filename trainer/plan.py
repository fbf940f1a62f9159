"""Plan a micro batch before its chunks are read: allocate its output arrays and name each sequence's targets.

Called by a trainer rank's fetch (``trainer.fetch``), which reads each chunk straight into the targets a plan
names, and by ``trainer.assemble.assemble_micro_batch``; ``trainer.assemble.finish_micro_batch`` completes a
plan into the layout its module docstring describes. Planning checks what the refs say against the field
declarations (stored dtypes, domains, trailing shapes, enough rows) before a byte is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from refpipe.pipeline.field_decl import FieldDecl, narrow_dtype
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_header import MicroBatchRecord, SequenceRecord
from refpipe.storage.chunk_ref import PayloadRef, domain_rows
from refpipe.storage.errors import FieldError, PackingError


@dataclass
class MicroBatchPlan:
    """A micro batch's output arrays, allocated (not yet written) before its chunks are read.

    ``targets[s]`` maps each stored array name whose rows sequence ``s`` contributes to its
    destination ``[rows, *row_shape]``, a slice of ``buffers`` (token-domain fields:
    ``padded[start_s : start_s + rows]``; completion fields: ``values[cu_rows[s] : cu_rows[s + 1]]``).
    Ragged fields have no targets. The plan decides which sequence's targets a ref's chunk is read
    into (``read_targets``); the reader reports the destinations it filled (``mark_read``), and
    ``trainer.assemble.finish_micro_batch`` copies rows only into the others.
    """

    mb: MicroBatchRecord
    refs: Sequence[PayloadRef]
    seq_len: int
    fields: FieldsConfig
    buffers: dict[str, np.ndarray]
    """Field name -> token fields: padded [seq_len, *row_shape]; completion fields: values [rows, *row_shape]."""
    cu_rows: dict[str, np.ndarray]
    """Field name -> [S + 1] int32 cumulative rows per sequence."""
    targets: list[dict[str, np.ndarray]]
    filled: set[tuple[int, str]] = field(default_factory=set)
    """``(sequence index, stored array name)`` of targets that already hold their rows."""
    empty: Callable[..., np.ndarray] = np.empty
    """What allocated ``buffers``; ``trainer.assemble.finish_micro_batch`` allocates the padded streams and row ids
    with it too."""

    def read_targets(self, ref: int, num_tokens: int) -> tuple[int, dict[str, np.ndarray]] | None:
        """Where to read ref ``ref`` cut to ``num_tokens`` tokens: ``(s, name -> destination)`` of the first
        sequence ``s`` that keeps exactly that many of its tokens (destinations whose dtype is the stored one),
        or None when no sequence of this micro batch does."""
        specs = self.refs[ref].arrays
        for s, (seq, targets) in enumerate(zip(self.mb.sequences, self.targets)):
            if seq.ref == ref and seq.num_tokens == num_tokens:
                return s, {name: t for name, t in targets.items() if t.dtype == np.dtype(specs[name].dtype)}
        return None

    def mark_read(self, s: int, names: Iterable[str]) -> None:
        """Record that sequence ``s``'s targets of ``names`` hold their rows (read straight into them)."""
        self.filled.update((s, name) for name in names)


def plan_micro_batch(mb: MicroBatchRecord, refs: Sequence[PayloadRef], *, seq_len: int,
                     fields: FieldsConfig, empty: Callable[..., np.ndarray] = np.empty) -> MicroBatchPlan:
    """Allocate ``mb``'s output arrays (``empty(shape, dtype)``, uninitialised: ``np.empty``, or a trainer
    rank's ``trainer.buffers.BufferPool.empty``) and each sequence's targets.

    A ``strided_ids`` field's rows (routing) are ``field_decl.narrow_dtype`` (routing: ``fields.routing_dtype``,
    sized from ``num_experts``, never from the refs); any other field's dtype is the result type of the
    dtypes its sequences' refs store.

    Raises:
        FieldError: a ref stores a field in a dtype or domain its declaration does not allow, rows of
            another trailing shape than ``fields`` says, or fewer rows than its sequence keeps; a micro batch
            with token-domain rows has a sequence without them.
        PackingError: ``mb`` has more than ``seq_len`` tokens.
    """
    what = f"micro batch dp_rank={mb.dp_rank} index={mb.index}"
    check_fits(mb, seq_len, what)
    buffers: dict[str, np.ndarray] = {}
    cu_rows: dict[str, np.ndarray] = {}
    targets: list[dict[str, np.ndarray]] = [{} for _ in mb.sequences]
    for fdef in laid_out(mb, fields):
        trailing = fdef.trailing(fields.dims)
        assert trailing is not None  # FieldsConfig validates that every configured field's dimensions are set
        rows = [_num_rows(fdef, seq, refs, trailing, what) for seq in mb.sequences]
        if fdef.domain == "tokens" and None in rows:
            missing = [i for i, n in enumerate(rows) if n is None]
            raise FieldError(f"{what}: sequences {missing} have no {fdef.name} rows in a micro batch with "
                             "token-domain rows")
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum([n or 0 for n in rows], out=cu[1:])
        cu_rows[fdef.name] = mb.cu_seqlens() if fdef.domain == "tokens" else cu
        if fdef.ragged:
            continue
        stored = [refs[seq.ref].arrays[fdef.name].dtype  # type: ignore[index]  # with rows: a ref (_num_rows)
                  for seq, n in zip(mb.sequences, rows) if n is not None]
        dtype = buffer_dtype(fdef, fields, stored)
        buffer = empty((seq_len if fdef.domain == "tokens" else int(cu[-1]), *trailing), dtype)
        buffers[fdef.name] = buffer
        starts = cu_rows[fdef.name]
        for s, n in enumerate(rows):
            if n is not None:
                targets[s][fdef.name] = buffer[starts[s] : starts[s] + n]
    return MicroBatchPlan(mb, refs, seq_len, fields, buffers, cu_rows, targets, empty=empty)


def check_fits(mb: MicroBatchRecord, seq_len: int, what: str) -> None:
    """Raise ``PackingError`` (naming ``what``) if ``mb`` has more than ``seq_len`` tokens."""
    if mb.num_tokens > seq_len:
        raise PackingError(f"{what}: {mb.num_tokens} tokens, expected at most seq_len={seq_len}")


def laid_out(mb: MicroBatchRecord, cfg: FieldsConfig) -> list[FieldDecl]:
    """Fields of the run, in registry order; token-domain ones only when the micro batch has token-domain rows."""
    return [f for f in cfg.registry().values() if f.domain != "tokens" or mb.has_routing]


def buffer_dtype(fdef: FieldDecl, cfg: FieldsConfig, ref_dtypes: list[str]) -> np.dtype:
    """``strided_ids``: ``narrow_dtype`` (routing: from ``num_experts``); other fields: the result type of the
    refs' dtypes."""
    if fdef.padding == "strided_ids":
        return narrow_dtype(fdef, cfg.dims)
    return np.result_type(*ref_dtypes) if ref_dtypes else np.dtype(fdef.dtypes[0])


def _num_rows(fdef: FieldDecl, seq: SequenceRecord, refs: Sequence[PayloadRef], trailing: tuple[int, ...],
              what: str) -> int | None:
    """Rows ``seq`` contributes to ``fdef`` (ragged: rows of counts), or None when it has none.

    Raises:
        FieldError: its ref stores the field in a dtype or domain the declaration does not allow, fewer
            rows, or rows of another trailing shape.
    """
    if seq.ref is None or (seq.borrowed and fdef.domain != "tokens"):
        return None
    ref = refs[seq.ref]
    stored = fdef.names()[0]
    spec = ref.arrays.get(stored)
    if spec is None:
        return None
    values = ref.arrays.get(fdef.names()[-1])
    if values is None or values.dtype not in fdef.dtypes or spec.domain != fdef.domain:
        got = None if values is None else f"{np.dtype(values.dtype)} in the {spec.domain} domain"
        raise FieldError(f"{what}: ref {seq.ref} ({ref.uri}) stores {fdef.name} as {got}: expected one of "
                         f"{[str(np.dtype(d)) for d in fdef.dtypes]} in the {fdef.domain} domain (its declaration)")
    num_rows = domain_rows(fdef.domain, ref.num_prompt_tokens, seq.num_tokens)
    if spec.shape[0] < num_rows or tuple(spec.shape[1:]) != (() if fdef.ragged else trailing):
        raise FieldError(f"{what}: ref {seq.ref} ({ref.uri}) stores {stored} as {list(spec.shape)}: expected at "
                         f"least {num_rows} rows of {list(trailing)}")
    return num_rows
