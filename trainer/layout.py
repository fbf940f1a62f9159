"""Where each position of a padded micro batch gets its rows: padded streams, ``cu_seqlens``, padding rows by a
field's padding rule, and the row ids of completion- and prompt-domain fields (``trainer.assemble``'s layout,
module docstring there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from refpipe.pipeline.field_decl import FieldDecl, padding_rows
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_header import STREAMS, MicroBatchRecord
from refpipe.storage.chunk_ref import PayloadRef

_STREAM_PADDING = {"input_ids": 0, "loss_mask": False, "advantages": 0.0, "inference_logprobs": 0.0,
                   "temperatures": 1.0}
"""Value of each stream at padding tokens (``position_ids`` count 0, 1, ... instead)."""


def pad_streams(streams: Mapping[str, np.ndarray], seq_len: int,
                empty: Callable[..., np.ndarray] = np.empty) -> dict[str, np.ndarray]:
    """Every stream ``[T]`` copied into ``[seq_len]`` of its ``STREAMS`` dtype (allocated with ``empty(shape,
    dtype)``), padded as ``trainer.assemble`` documents; an extra stream (``StepHeader.extra_streams``) keeps its
    dtype and is padded with 0."""
    out = {}
    for name, real in streams.items():
        a = empty((seq_len,), STREAMS.get(name, real.dtype))
        a[: len(real)] = real
        a[len(real):] = _counting(seq_len)[: seq_len - len(real)] if name == "position_ids" else (
            _STREAM_PADDING.get(name, 0))
        out[name] = a
    return out


def padded_cu_seqlens(mb: MicroBatchRecord, seq_len: int) -> np.ndarray:
    """int32 ``mb.cu_seqlens()`` with ``seq_len`` appended when the micro batch is padded."""
    cu = mb.cu_seqlens()
    if mb.num_tokens >= seq_len:
        return cu
    out = np.empty(len(cu) + 1, np.int32)
    out[:-1], out[-1] = cu, seq_len
    return out


def padding_rows_of(fdef: FieldDecl, num_rows: int, cfg: FieldsConfig, dtype: np.dtype,
                  real: np.ndarray | None) -> np.ndarray:
    """Rows for padding tokens of a token-domain field by its padding rule (read-only: copy before writing);
    ``repeat_rows`` repeats ``real`` [T, *row_shape] cyclically (zeros when there are none)."""
    trailing = fdef.trailing(cfg.dims)
    assert trailing is not None  # FieldsConfig validates that every configured field's dimensions are set
    if fdef.padding == "repeat_rows" and real is not None and len(real):
        return np.resize(real, (num_rows, *trailing))
    return _cached_padding(fdef, num_rows, trailing, tuple(cfg.dims.items()), np.dtype(dtype).str)


@functools.lru_cache(maxsize=16)
def _cached_padding(fdef: FieldDecl, num_rows: int, trailing: tuple[int, ...], dims: tuple, dtype: str) -> np.ndarray:
    """``field_decl.padding_rows``, computed once per shape: every micro batch of a step pads alike."""
    rows = padding_rows(fdef, num_rows, trailing, dict(dims), np.dtype(dtype))
    rows.flags.writeable = False
    return rows


def field_row_ids(domain: str, mb: MicroBatchRecord, refs: Sequence[PayloadRef], cu_rows: np.ndarray,
                  seq_len: int, empty: Callable[..., np.ndarray] = np.empty) -> np.ndarray:
    """[seq_len] int64 row of a ``completion`` or ``prompt`` field per position, -1 elsewhere (module docstring),
    allocated with ``empty(shape, dtype)``.

    Args:
        cu_rows: [S + 1] int32 cumulative rows of the field per sequence (0 for sequences without rows).
    """
    row_ids = empty((seq_len,), np.int64)
    row_ids[:] = -1
    counting, starts = _counting(seq_len), mb.cu_seqlens()
    for s, seq in enumerate(mb.sequences):
        first_row, end_row = int(cu_rows[s]), int(cu_rows[s + 1])
        if first_row == end_row:
            continue
        first = int(starts[s])  # prompt row r: its own position
        if domain == "completion":
            assert seq.ref is not None  # a sequence with rows has a ref
            first += refs[seq.ref].num_prompt_tokens - 1  # the position predicting completion row 0
            if first < starts[s]:  # no prompt: nothing in this sequence predicts row 0
                first, first_row = first + 1, first_row + 1
        row_ids[first : first + end_row - first_row] = counting[first_row:end_row]
    return row_ids


@functools.lru_cache(maxsize=4)
def _counting(n: int) -> np.ndarray:
    """Read-only int64 ``[0, 1, ..., n - 1]``, made once per length (the row ids and padding positions of a step)."""
    a = np.arange(n, dtype=np.int64)
    a.flags.writeable = False
    return a
