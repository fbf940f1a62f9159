"""Assemble one micro batch into the padded layout the model consumes (numpy only, no torch).

Used by the trainer ranks (``trainer.step``) and by offline inspection (``refpipe show``):
importable without torch, deterministic, and it copies each kept row exactly once.

Layout of a micro batch with ``T`` real tokens in ``S`` sequences, padded to ``seq_len``:

- ``streams``: every ``pipeline.step_header.STREAMS`` entry as ``[seq_len]`` of its step-file
  dtype. Padding tokens get ``input_ids`` 0, ``loss_mask`` False, ``advantages`` and
  ``inference_logprobs`` 0, ``temperatures`` 1, ``position_ids`` 0, 1, 2, ... (the padding
  is its own sequence).
- ``cu_seqlens`` int32: ``[S + 1]`` cumulative sequence lengths, plus ``seq_len`` as the
  end of one more sequence (the padding) when ``T < seq_len``.
- ``fields``: one ``FieldBatch`` per field of ``FieldsConfig.registry`` (token-domain fields, such
  as ``routed_experts``, only when the micro batch has token-domain rows: ``has_routing``), laid out
  by its declaration (domain, padding rule), never by its name:

  - ``values``: the field's rows of every sequence concatenated in packing order,
    ``[sum of rows, *row_shape]``; ``cu_seqlens`` int32 ``[S + 1]`` counts rows per sequence.
    For a ragged field (``sampling_mask``): ``counts`` int32 ``[rows]`` and ``values`` the ids
    ``[sum(counts)]``.
  - token-domain fields: ``padded [seq_len, *row_shape]``, the real rows followed by padding
    rows from the field's padding rule (``zeros``, ``repeat_rows``: the real rows cyclically,
    ``strided_ids``: ``pipeline.field_decl.strided_rows``); ``values`` is the view ``padded[:T]``.
  - completion-domain fields: ``row_ids`` int64 ``[seq_len]``. Completion row ``r`` of a
    sequence (``values[cu_seqlens[s] + r]``) belongs to the position whose logits predict
    completion token ``r``: the position just before that token, ``start_s + P_s + r - 1``
    (``P_s`` = the ref's prompt tokens). Every other position holds -1: prompt-only
    positions, the last position of each sequence, sequences without rows, and padding.
  - prompt-domain fields: ``row_ids`` int64 ``[seq_len]``: prompt row ``r`` belongs to the prompt
    token's own position ``start_s + r``; every other position holds -1.

Whatever a ref says is checked before anything trains from it: its stored dtypes and domains against
the declarations (``trainer.plan.plan_micro_batch``) and every row's values against the declared bounds
(``finish_micro_batch``: ids below ``num_experts``, finite logprobs, ...); a micro batch failing either
raises ``FieldError``, which a trainer rank counts as a dropped micro batch on every rank. A trainer rank checks
each chunk's arrays whole right after their read, while they are in cache (``clean_fetched``); assembly then checks
again only the rows of arrays that failed there, so a micro batch fails exactly when its own rows break a bound.

Which sequences have rows: a sequence without a ref has none (empty rows); a borrowed
padding dummy has its ref's token-domain (routing) rows only; any other sequence has the
rows of its ref's first ``num_tokens`` tokens, for each field its ref carries.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from refpipe.pipeline.field_checks import check_bounds
from refpipe.pipeline.field_decl import FieldDecl
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_header import MicroBatchRecord, SequenceRecord
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import FieldError
from refpipe.trainer.layout import field_row_ids, pad_streams, padded_cu_seqlens, padding_rows_of
from refpipe.trainer.plan import MicroBatchPlan, buffer_dtype, check_fits, laid_out, plan_micro_batch


@dataclass(frozen=True)
class FieldBatch:
    """One field of one assembled micro batch (see the module docstring for the layout)."""

    values: np.ndarray
    """[sum of rows, *row_shape] rows in packing order (ragged: ids int32 [sum(counts)])."""
    cu_seqlens: np.ndarray
    """[S + 1] int32 cumulative rows per sequence."""
    counts: np.ndarray | None = None
    """Ragged fields: [rows] int32 ids per row; else None."""
    padded: np.ndarray | None = None
    """Token-domain fields: [seq_len, *row_shape], real rows then padding rows; else None."""
    row_ids: np.ndarray | None = None
    """Completion- and prompt-domain fields: [seq_len] int64 row of ``values``/``counts`` per position, -1 = none."""


@dataclass(frozen=True)
class AssembledMicroBatch:
    """One micro batch in the padded layout the model consumes (numpy arrays)."""

    record: MicroBatchRecord
    """The step file's record of this micro batch (DP rank, index, sequences, policy versions)."""
    seq_len: int
    streams: dict[str, np.ndarray]
    """name -> [seq_len] array of ``STREAMS[name]``."""
    cu_seqlens: np.ndarray
    """int32 [S + 1], or [S + 2] ending at ``seq_len`` when there is padding."""
    fields: dict[str, FieldBatch]
    dropped: bool = False
    """Its chunks could not be fetched on some rank: ``loss_mask`` is all False, completion
    fields are empty and routing repeats real rows; train it for shape only, never for loss."""

    @property
    def dp_rank(self) -> int:
        return self.record.dp_rank

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def num_tokens(self) -> int:
        """Real tokens ``T`` (the rest of ``seq_len`` is padding)."""
        return self.record.num_tokens


def assemble_micro_batch(
    mb: MicroBatchRecord,
    streams: Mapping[str, np.ndarray],
    arrays: Mapping[int, Mapping[str, np.ndarray]],
    refs: Sequence[PayloadRef],
    *,
    seq_len: int,
    fields: FieldsConfig,
) -> AssembledMicroBatch:
    """Cut every sequence's rows out of its fetched chunk and lay them out for the model.

    ``finish_micro_batch(plan_micro_batch(...), streams, arrays)``.

    Args:
        mb: the micro batch record (``StepHeader.micro_batches``).
        streams: its token streams as ``StepFile.streams`` returns them: name -> [T].
        arrays: ref index -> fetched arrays (``storage.chunk_read.fetch_arrays``), cut to at least
            as many tokens as every sequence of ``mb`` using that ref keeps.
        refs: ``StepHeader.refs`` (prompt lengths and which arrays each ref carries).
        seq_len: ``StepHeader.seq_len``; tokens, ``>= mb.num_tokens``.
        fields: the run's field shapes; decides which fields are laid out.

    Returns:
        The ``AssembledMicroBatch`` described in the module docstring; every array is a
        fresh, writable copy (nothing aliases ``arrays`` or ``streams``).

    Raises:
        FieldError: a sequence's ref has no fetched arrays, fewer rows than it keeps, or
            rows of another trailing shape than ``fields`` says; a routing micro batch has
            a sequence without routing rows.
        PackingError: ``mb`` has more than ``seq_len`` tokens.
    """
    return finish_micro_batch(plan_micro_batch(mb, refs, seq_len=seq_len, fields=fields), streams, arrays)


def finish_micro_batch(plan: MicroBatchPlan, streams: Mapping[str, np.ndarray],
                       arrays: Mapping[int, Mapping[str, np.ndarray]],
                       clean: Mapping[int, Collection[str]] | None = None) -> AssembledMicroBatch:
    """Complete a planned micro batch: copy rows not already read into their targets, pad, lay out.

    Args:
        plan: from ``plan_micro_batch``; its buffers become the result's arrays.
        streams: name -> [T] as ``StepFile.streams`` returns them.
        arrays: ref index -> fetched arrays, as for ``assemble_micro_batch``; targets marked read
            (``MicroBatchPlan.mark_read``) are not copied again.
        clean: ref index -> names of its fetched arrays whose every row passed its bounds (``clean_fetched`` of
            exactly those arrays): their rows are not checked again; default: every row is checked here.

    Raises:
        FieldError: a sequence with loss tokens lacks a field of ``FieldsConfig.required``; a
            sequence's ref has no fetched arrays, fewer rows than it keeps, rows of another
            trailing shape, or a value outside its declared bounds.
    """
    mb, what = plan.mb, f"micro batch dp_rank={plan.mb.dp_rank} index={plan.mb.index}"
    _check_required(plan, streams["loss_mask"], what)
    registry, clean = plan.fields.registry(), clean or {}
    for s, (seq, targets) in enumerate(zip(mb.sequences, plan.targets)):
        for name, dest in targets.items():
            assert seq.ref is not None  # a sequence with targets has a ref
            where = f"{what}: ref {seq.ref} ({plan.refs[seq.ref].uri})"
            src = dest if (s, name) in plan.filled else _cut(_fetched(arrays, seq, plan.refs, what), name,
                                                              len(dest), dest.shape[1:], where)
            if name not in clean.get(seq.ref, ()):
                _check_fetched(src, registry[name], plan.fields, f"{where}: field {name!r}")
            if src is not dest:
                dest[...] = src
    out: dict[str, FieldBatch] = {}
    made: dict[tuple[str, bytes], np.ndarray] = {}
    for fdef in laid_out(mb, plan.fields):
        cu = plan.cu_rows[fdef.name]
        if fdef.domain == "tokens":
            padded = plan.buffers[fdef.name]
            padded[mb.num_tokens:] = padding_rows_of(fdef, plan.seq_len - mb.num_tokens, plan.fields, padded.dtype,
                                                   padded[: mb.num_tokens])
            out[fdef.name] = FieldBatch(padded[: mb.num_tokens], cu, padded=padded)
            continue
        if fdef.ragged:
            values, counts = _ragged_values(fdef, plan, arrays, clean, what)
        else:
            values, counts = plan.buffers[fdef.name], None  # every laid-out field that is not ragged has one
        out[fdef.name] = FieldBatch(values, cu, counts=counts, row_ids=_row_ids(plan, fdef.domain, cu, made))
    return AssembledMicroBatch(mb, plan.seq_len, pad_streams(streams, plan.seq_len, plan.empty),
                               padded_cu_seqlens(mb, plan.seq_len), out)


def assemble_dropped_micro_batch(
    mb: MicroBatchRecord,
    streams: Mapping[str, np.ndarray],
    *,
    seq_len: int,
    fields: FieldsConfig,
    token_rows: Mapping[str, np.ndarray] | None,
) -> AssembledMicroBatch:
    """The stand-in for a micro batch whose chunks could not be fetched: shapes only, no loss.

    Streams are padded as usual with ``loss_mask`` all False; completion- and prompt-domain fields
    are empty (``row_ids`` all -1). With token-domain rows, each such field's ``padded [seq_len,
    *row_shape]`` repeats its ``token_rows`` (real rows of a micro batch that was fetched, e.g. the
    first one of the same DP rank, so every model-parallel peer picks the same: ``real_token_rows``)
    cyclically; with no real rows (None, missing or empty) it uses the padding rule for every position.

    Raises:
        PackingError: ``mb`` has more than ``seq_len`` tokens.
    """
    check_fits(mb, seq_len, f"micro batch dp_rank={mb.dp_rank} index={mb.index}")
    out: dict[str, FieldBatch] = {}
    num_sequences = len(mb.sequences)
    for fdef in laid_out(mb, fields):
        trailing = fdef.trailing(fields.dims)
        assert trailing is not None  # FieldsConfig validates that every configured field's dimensions are set
        if fdef.domain == "tokens":
            real = (token_rows or {}).get(fdef.name)
            dtype = buffer_dtype(fdef, fields, [] if real is None else [real.dtype.str])
            if real is None or len(real) == 0:
                padded = padding_rows_of(fdef, seq_len, fields, dtype, real).copy()
            else:
                padded = np.resize(real, (seq_len, *trailing)).astype(dtype, copy=False)
            out[fdef.name] = FieldBatch(padded[: mb.num_tokens], mb.cu_seqlens(), padded=padded)
        else:
            empty = np.empty((0, *trailing), np.dtype(fdef.dtypes[0]))
            out[fdef.name] = FieldBatch(empty, np.zeros(num_sequences + 1, np.int32),
                                        counts=np.empty(0, np.int32) if fdef.ragged else None,
                                        row_ids=np.full(seq_len, -1, np.int64))
    padded_streams = pad_streams(streams, seq_len)
    padded_streams["loss_mask"][:] = False
    return AssembledMicroBatch(mb, seq_len, padded_streams,
                               padded_cu_seqlens(mb, seq_len), out, dropped=True)


def real_token_rows(mb: AssembledMicroBatch) -> dict[str, np.ndarray]:
    """Field name -> real rows ``[T, *row_shape]`` of each token-domain field of ``mb`` (a dropped micro
    batch's ``token_rows``)."""
    return {name: batch.values for name, batch in mb.fields.items() if batch.padded is not None}


def clean_fetched(arrays: Mapping[str, np.ndarray], fields: FieldsConfig) -> frozenset[str]:
    """Names of one chunk's fetched arrays (stored name -> array in the chunk's order, as
    ``storage.chunk_read.fetch_into`` returns them) whose every value passes its field's declared bounds
    (``pipeline.field_checks.check_bounds``: the fetch-time checks; a ragged field's ids), for
    ``finish_micro_batch``'s ``clean``.

    Called by a trainer rank's fetch thread right after the chunk's read, while its bytes are in cache: the last
    array read first (the core's own cache holds the chunk's end). An array left out is checked again by
    ``finish_micro_batch`` over the rows each micro batch keeps of it, which names the first bad value there, or
    finds none in a shorter cut.
    """
    declared = {fdef.names()[-1]: fdef for fdef in fields.registry().values()}
    out = []
    for name in reversed(list(arrays)):
        fdef = declared.get(name)
        if fdef is not None and check_bounds(arrays[name], fdef.checks, fields.dims, fdef.shape) is None:
            out.append(name)
    return frozenset(out)


def _check_fetched(a: np.ndarray, fdef: FieldDecl, cfg: FieldsConfig, what: str) -> None:
    """Raise ``FieldError`` if fetched rows break their declared bounds (before they are cast or trained)."""
    problem = check_bounds(a, fdef.checks, cfg.dims, fdef.shape)
    if problem:
        raise FieldError(f"{what}: {problem} (a foreign or damaged chunk: the micro batch is not trained)")


def _row_ids(plan: MicroBatchPlan, domain: str, cu: np.ndarray,
             made: dict[tuple[str, bytes], np.ndarray]) -> np.ndarray:
    """``field_row_ids`` of a field of ``plan``'s micro batch, in its own array: laid out once per domain and rows per
    sequence (``made``: the ones laid out already; a ref's completion fields share them) and copied for the others."""
    key = (domain, cu.tobytes())
    first = made.get(key)
    if first is None:
        made[key] = field_row_ids(domain, plan.mb, plan.refs, cu, plan.seq_len, plan.empty)
        return made[key]
    row_ids = plan.empty(first.shape, first.dtype)
    row_ids[...] = first
    return row_ids


def _check_required(plan: MicroBatchPlan, loss_mask: np.ndarray, what: str) -> None:
    """Raise ``FieldError`` if a sequence with loss tokens lacks a field of ``FieldsConfig.required``.

    A borrowed padding dummy has no loss tokens; it only needs token-domain rows, which it borrows.
    """
    if not plan.fields.required:
        return
    registry, starts = plan.fields.registry(), plan.mb.cu_seqlens()
    for s, seq in enumerate(plan.mb.sequences):
        stored = () if seq.ref is None else plan.refs[seq.ref].arrays
        missing = [name for name in plan.fields.required if registry[name].names()[0] not in stored]
        loss_tokens = int(np.count_nonzero(loss_mask[starts[s] : starts[s + 1]])) if missing else 0
        if loss_tokens:
            raise FieldError(f"{what}: sequence {s} (env {seq.env_name!r}, ref {seq.ref}) trains {loss_tokens} "
                             f"loss tokens without required fields {missing} (FieldsConfig.required)")


def _fetched(arrays: Mapping[int, Mapping[str, np.ndarray]], seq: SequenceRecord, refs: Sequence[PayloadRef],
             what: str) -> Mapping[str, np.ndarray]:
    assert seq.ref is not None  # called for sequences with targets, which have a ref
    got = arrays.get(seq.ref)
    if got is None:
        raise FieldError(f"{what}: no fetched arrays for ref {seq.ref} ({refs[seq.ref].uri})")
    return got


def _ragged_values(fdef: FieldDecl, plan: MicroBatchPlan, arrays: Mapping[int, Mapping[str, np.ndarray]],
                   clean: Mapping[int, Collection[str]], what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, counts)`` of a ragged field: every sequence's kept rows concatenated in packing order."""
    ids, counts = [], []
    cu = plan.cu_rows[fdef.name]
    counts_name, ids_name = fdef.names()
    for s, seq in enumerate(plan.mb.sequences):
        if seq.ref is None or seq.borrowed or counts_name not in plan.refs[seq.ref].arrays:
            continue
        num_rows = int(cu[s + 1] - cu[s])
        got = _fetched(arrays, seq, plan.refs, what)
        where = f"{what}: ref {seq.ref} ({plan.refs[seq.ref].uri})"
        counts.append(_cut(got, counts_name, num_rows, (), where))
        ids.append(_cut(got, ids_name, int(counts[-1].sum(dtype=np.int64)), (), where))
        if ids_name not in clean.get(seq.ref, ()):
            _check_fetched(ids[-1], fdef, plan.fields, f"{where}: field {ids_name!r}")
    empty = np.empty(0, np.dtype(fdef.dtypes[0]))
    return (np.concatenate(ids) if ids else empty), (np.concatenate(counts) if counts else empty.copy())


def _cut(got: Mapping[str, np.ndarray], name: str, num_rows: int, trailing: tuple[int, ...], where: str) -> np.ndarray:
    a = got.get(name)
    if a is None or a.shape[0] < num_rows or a.shape[1:] != trailing:
        shape = None if a is None else list(a.shape)
        raise FieldError(f"{where}: array {name} is {shape}: expected at least {num_rows} rows of {list(trailing)}")
    return a[:num_rows]
