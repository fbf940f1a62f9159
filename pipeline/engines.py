"""Routing rows as inference engines return them, turned into what ``Keeper.keep`` takes (numpy, any integer dtype).

Every engine below records routing for the positions that went through a forward pass: the prompt and every
sampled token but the last, so P + C - 1 rows. Keep takes them with ``FieldsConfig.routing_rows =
"all_but_last"`` (the last row is filled by the padding rule); the integer dtype is narrowed at keep after
the range check (``pipeline.fields.validate_branch``). These adapters only decode and check the row count.

- SGLang (``return_routed_experts``): a base64 string of the flattened little-endian int32 array
  ``[rows, num_layers, top_k]`` for positions ``[routed_experts_start_len, seqlen - 1)``; with
  ``routed_experts_start_len = 0`` that is the whole sequence, else a suffix whose earlier rows the caller kept
  from an earlier turn (``sglang_routed_experts(..., earlier=...)``).
- vLLM: ``[n - 1, num_layers, top_k]`` integer rows (numpy or a CPU tensor).
- TensorRT-LLM: int16 ``[n - 1, num_layers, top_k]``.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from refpipe.pipeline.fields import as_numpy
from refpipe.storage.errors import FieldError

ROUTING_ROWS_SETTING = 'FieldsConfig.routing_rows = "all_but_last"'
"""The setting that makes keep take the P + C - 1 rows every adapter here returns."""


def sglang_routed_experts(data: str | bytes, *, num_tokens: int, num_layers: int, top_k: int, start_len: int = 0,
                          earlier: np.ndarray | None = None) -> np.ndarray:
    """Decode SGLang's ``routed_experts`` into int32 ``[num_tokens - 1, num_layers, top_k]``.

    Args:
        data: the response's base64 string (rows ``[start_len, num_tokens - 1)``, int32 little-endian).
        num_tokens: the sequence's tokens (prompt + completion, ``seqlen``).
        start_len: the request's ``routed_experts_start_len`` (0 = the whole sequence; at most the prompt).
        earlier: with ``start_len > 0``, routing rows of the sequence's first ``start_len`` positions
            (e.g. the previous turn's decoded rows); only its first ``start_len`` rows are used.

    Raises:
        FieldError: not base64; a byte count that is not whole int32 rows of ``[num_layers, top_k]``; another
            number of rows than ``num_tokens - 1 - start_len``; ``earlier`` missing or shorter than ``start_len``.
    """
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise FieldError(f"SGLang routed_experts: not base64 ({e})") from None
    row_bytes = 4 * num_layers * top_k
    expected = num_tokens - 1 - start_len
    if len(raw) % row_bytes or len(raw) // row_bytes != expected:
        raise FieldError(f"SGLang routed_experts: {len(raw)} bytes: expected {expected} rows of int32 [{num_layers}, "
                         f"{top_k}] ({expected * row_bytes} bytes: positions [{start_len}, {num_tokens - 1}) of "
                         f"{num_tokens} tokens; set routed_experts_start_len to what the request sent)")
    rows = np.frombuffer(raw, "<i4").reshape(expected, num_layers, top_k)
    if not start_len:
        return rows
    if earlier is None or len(earlier) < start_len:
        got = None if earlier is None else len(earlier)
        raise FieldError(f"SGLang routed_experts from routed_experts_start_len={start_len}: earlier holds {got} rows: "
                         f"expected the first {start_len} rows of the sequence (an earlier turn's routing)")
    head = as_numpy(earlier, "SGLang routed_experts earlier rows")[:start_len]
    return np.concatenate([head.astype("<i4", copy=False), rows])


def engine_routed_experts(rows: object, *, num_tokens: int, engine: str) -> np.ndarray:
    """vLLM's or TensorRT-LLM's routing rows (numpy or CPU tensor, any integer dtype), checked to be P + C - 1.

    Raises:
        FieldError: not an integer ``[num_tokens - 1, layers, top_k]`` array; the message names the rows
            keep needs and the setting (``ROUTING_ROWS_SETTING``).
    """
    a = as_numpy(rows, f"{engine} routed_experts")
    if a.dtype.kind not in "iu" or a.ndim != 3 or a.shape[0] != num_tokens - 1:
        raise FieldError(f"{engine} routed_experts is {a.dtype} {list(a.shape)}: expected integer [{num_tokens - 1}, "
                         f"layers, top_k] (P + C - 1 rows of {num_tokens} tokens, kept with {ROUTING_ROWS_SETTING})")
    return a
