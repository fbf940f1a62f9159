"""Routing rows as inference engines return them, turned into what ``Keeper.keep`` takes (numpy, any integer dtype)
and, turn by turn, into the new rows an open branch appends.

Every engine below records routing for the positions that went through a forward pass: the prompt and every
sampled token but the last, so P + C - 1 rows. Keep takes them with ``FieldsConfig.routing_rows =
"all_but_last"`` (the last row is filled by the padding rule); the integer dtype is narrowed at keep after
the range check (``pipeline.fields.validate_branch``). The whole-sequence adapters only decode and check the row count.

- SGLang (``return_routed_experts``): a base64 string of the flattened little-endian int32 array
  ``[rows, num_layers, top_k]`` for positions ``[routed_experts_start_len, seqlen - 1)``; with
  ``routed_experts_start_len = 0`` that is the whole sequence, else a suffix whose earlier rows the caller kept
  from an earlier turn (``sglang_routed_experts(..., earlier=...)``, or ``sglang_suffix_rows`` per turn).
- vLLM: ``[n - 1, num_layers, top_k]`` integer rows (numpy or a CPU tensor).
- TensorRT-LLM: int16 ``[n - 1, num_layers, top_k]``.
- R3/v1 routing blobs (``r3_routing_rows``): zstd-compressed, base64, one routing matrix per selected position.

Per turn (a multi-turn trace whose turn k is one engine request over the whole context so far): after turn k the
trace holds ``n_k`` tokens and ``n_k - 1`` rows; the missing row (the last token of turn k) went through no forward
pass until turn k + 1's prefill, whose response carries it. The per-turn adapters (``sglang_suffix_rows``,
``TurnRows``, ``r3_routing_rows``) return only the rows the branch lacks, checked against the routing field's
declaration (shape, ``0 <= id < num_experts``, distinct per (token, layer)) and narrowed to
``FieldsConfig.routing_dtype``; none ever returns a placeholder row, so a zero row that no later turn replaces
cannot arise. After the last turn one row is missing: the branch is closed with ``routing_rows = "all_but_last"``,
whose padding rule fills it.
"""


from __future__ import annotations

import base64
import binascii
import struct

import numpy as np
from numcodecs import Zstd

from refpipe.pipeline.field_checks import check_values
from refpipe.pipeline.fields import FIELDS, FieldsConfig, as_numpy
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
    rows = _sglang_rows(data, num_tokens=num_tokens, num_layers=num_layers, top_k=top_k, start_len=start_len)
    if not start_len:
        return rows
    if earlier is None or len(earlier) < start_len:
        got = None if earlier is None else len(earlier)
        raise FieldError(f"SGLang routed_experts from routed_experts_start_len={start_len}: earlier holds {got} rows: "
                         f"expected the first {start_len} rows of the sequence (an earlier turn's routing)")
    head = as_numpy(earlier, "SGLang routed_experts earlier rows")[:start_len]
    return np.concatenate([head.astype("<i4", copy=False), rows])


def sglang_suffix_rows(data: str | bytes, *, start_len: int, rows_held: int, num_tokens: int,
                       cfg: FieldsConfig) -> np.ndarray:
    """One turn's new routing rows from SGLang's suffix form, ready to append to the open branch.

    Env-server process, once per turn. Wire format (SGLang ``GenerateReqInput.routed_experts_start_len``,
    python/sglang/srt/managers/io_struct.py; returned as ``meta_info["routed_experts"]``): base64 of the
    flattened little-endian int32 ``[num_tokens - 1 - start_len, num_layers, top_k]``, the rows of positions
    ``[start_len, num_tokens - 1)``. Send ``routed_experts_start_len = rows_held`` (at most the turn's prompt,
    as SGLang requires): the suffix then starts with the previous turn's last token, whose row only this
    turn's prefill computed.

    Args:
        data: the response's base64 ``routed_experts``.
        start_len: the ``routed_experts_start_len`` the request sent.
        rows_held: routing rows the open branch holds (positions ``[0, rows_held)``; 0 before the first turn).
        num_tokens: the turn's sequence (prompt + completion, the whole context so far).
        cfg: the run's fields (``routed_experts`` configured).

    Returns:
        ``[num_tokens - 1 - rows_held, num_layers, top_k]`` in ``cfg.routing_dtype``, positions
        ``[rows_held, num_tokens - 1)``.

    Raises:
        FieldError: ``start_len != rows_held`` (a suffix starting at another position than the branch's end);
            not base64; another byte count than those rows of int32; an id out of ``[0, num_experts)`` or
            repeated within a (token, layer); ``routed_experts`` not configured.
    """
    num_layers, top_k = _routing_dims(cfg)
    if start_len != rows_held:
        raise FieldError(f"SGLang routed_experts from routed_experts_start_len={start_len}: the open branch holds "
                         f"{rows_held} rows: expected a suffix from position {rows_held} (send "
                         f"routed_experts_start_len={rows_held})")
    rows = _sglang_rows(data, num_tokens=num_tokens, num_layers=num_layers, top_k=top_k, start_len=start_len)
    return _checked_rows(rows, cfg, "SGLang routed_experts", first=start_len)


def _sglang_rows(data: str | bytes, *, num_tokens: int, num_layers: int, top_k: int, start_len: int) -> np.ndarray:
    """SGLang's base64 int32 rows of positions ``[start_len, num_tokens - 1)``, decoded and counted."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise FieldError(f"SGLang routed_experts: not base64 ({e})") from None
    row_bytes = 4 * num_layers * top_k
    expected = num_tokens - 1 - start_len
    if expected < 0 or len(raw) % row_bytes or len(raw) // row_bytes != expected:
        raise FieldError(f"SGLang routed_experts: {len(raw)} bytes: expected {expected} rows of int32 [{num_layers}, "
                         f"{top_k}] ({expected * row_bytes} bytes: positions [{start_len}, {num_tokens - 1}) of "
                         f"{num_tokens} tokens; set routed_experts_start_len to what the request sent)")
    return np.frombuffer(raw, "<i4").reshape(expected, num_layers, top_k)


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


class TurnRows:
    """The routing rows of one multi-turn trace, emitted turn by turn from per-request P + C - 1 rows.

    Env-server process, one per open branch, called once per turn in order, then ``close`` once. An engine that
    returns routing per request (vLLM ``CompletionOutput.routed_experts``, int16 ``[P + C - 1, layers, top_k]``;
    vllm/outputs.py) covers positions ``[0, P + C - 1)`` of that request, where the prompt P is the whole
    context so far. The row of turn k's last token is missing after turn k; it comes with turn k + 1's prefill.
    ``turn`` returns exactly the rows the branch lacks, so the emitted rows are always positions
    ``[0, num_tokens - 1)``: nothing is padded or zero-filled in between, and a turn whose rows do not reach
    back to the pending row is refused. ``close`` says how many rows are still missing (the last token's, filled
    by the padding rule of ``routing_rows = "all_but_last"`` when the branch closes).
    """

    def __init__(self, cfg: FieldsConfig, *, engine: str = "vLLM") -> None:
        _routing_dims(cfg)
        self._cfg, self._engine = cfg, engine
        self.num_tokens = 0
        """Tokens of the trace so far (the last turn's prompt + completion)."""
        self.turns = 0
        """Turns taken so far."""
        self._closed = False

    @property
    def rows_held(self) -> int:
        """Rows emitted so far: positions ``[0, rows_held)``, ``num_tokens - 1`` after the first turn."""
        return max(self.num_tokens - 1, 0)

    def turn(self, rows: object, *, num_prompt_tokens: int, num_completion_tokens: int,
             first_row: int = 0) -> np.ndarray:
        """This turn's new rows: positions ``[rows_held, P + C - 1)`` in ``cfg.routing_dtype``.

        Args:
            rows: the request's routing rows (numpy or a CPU tensor, any integer dtype), positions
                ``[first_row, P + C - 1)``.
            num_prompt_tokens: P, the request's prompt (the trace so far plus this turn's new context).
            num_completion_tokens: C, the tokens this request generated.
            first_row: the position of ``rows[0]`` (0: the engine returned the whole request).

        Raises:
            FieldError: naming the turn: called after ``close``; a prompt shorter than the trace; another row
                count than ``P + C - 1 - first_row``; rows starting after the pending row (this turn's prefill
                did not cover the previous turn's last token); an id out of range or repeated.
        """
        what = f"{self._engine} routed_experts of turn {self.turns + 1}"
        if self._closed:
            raise FieldError(f"{what}: the trace was closed after turn {self.turns}: expected no further turns")
        if num_prompt_tokens < self.num_tokens:
            raise FieldError(f"{what}: prompt of {num_prompt_tokens} tokens: expected at least the {self.num_tokens} "
                             "tokens of the trace so far (a prompt that extends it)")
        a = as_numpy(rows, what)
        end = num_prompt_tokens + num_completion_tokens - 1
        if a.ndim != 3 or a.shape[0] != end - first_row:
            raise FieldError(f"{what} has shape {list(a.shape)}: expected [{end - first_row}, num_layers, top_k] "
                             f"(positions [{first_row}, {end}): P + C - 1 rows of {end + 1} tokens from "
                             f"first_row={first_row})")
        if first_row > self.rows_held:
            why = (f"the row of turn {self.turns}'s last token, position {self.rows_held}, comes only from this "
                   "turn's prefill" if self.turns else "the first turn's rows start at the sequence's start")
            raise FieldError(f"{what}: rows start at position {first_row}: expected rows from position "
                             f"{self.rows_held} on ({why})")
        new = _checked_rows(a[self.rows_held - first_row:], self._cfg, what, first=self.rows_held)
        self.num_tokens, self.turns = end + 1, self.turns + 1
        return new

    def close(self) -> int:
        """End the trace; returns the rows still missing: 1 (the last token's; the padding rule of
        ``routing_rows = "all_but_last"`` fills it at close), 0 for a trace without tokens."""
        self._closed = True
        return self.num_tokens - self.rows_held


R3_HEADER = struct.Struct("<4sBBBBIIIIQ")
"""R3/v1 header (32 bytes, little-endian): magic ``b"R3V1"``, version (1), selector mode (0 ALL, 1 SUFFIX,
2 BITMAP), routing dtype (1 uint8, 2 uint16: its byte width), flags (bit 0: little-endian matrices),
total_token_count, replayed_token_count, replay_start_token, selector_byte_length (u32 each),
matrix_byte_length (u64)."""
_R3_MODES = {0: "ALL", 1: "SUFFIX", 2: "BITMAP"}


def r3_routing_rows(data: str | bytes, *, rows_held: int, num_tokens: int, cfg: FieldsConfig) -> np.ndarray:
    """One turn's new routing rows from an R3/v1 router-replay blob, ready to append to the open branch.

    Env-server process, once per turn. Wire format (the public reader: eval-protocol/python-sdk,
    eval_protocol/adapters/r3_deserializer.py and tests/adapters/test_r3_deserializer.py,
    https://github.com/eval-protocol/python-sdk/pull/450): base64 of zstd (one frame, or the concatenated frames of
    a payload compressed in chunks) of ``R3_HEADER``, then
    ``selector_byte_length`` selector bytes, then ``matrix_byte_length`` bytes of ``replayed_token_count``
    routing matrices, one per selected position in position order, each ``[num_layers, top_k]`` of the routing
    dtype (the reader splits the matrices by size only; the layer-major order of SGLang's and vLLM's rows is
    assumed). Selectors: ALL selects positions ``[0, total_token_count)``; SUFFIX ``[replay_start_token,
    replay_start_token + replayed_token_count)``; BITMAP position i when bit ``i & 7`` of selector byte ``i >> 3``
    is set. Every mode gives the turn's rows of positions ``[rows_held, num_tokens - 1)``, what the branch lacks: a
    selected row of the last position (``num_tokens - 1``; ALL always selects it) is dropped, since that row comes
    with the next turn's prefill (as SGLang's and vLLM's rows); ALL's rows before ``rows_held`` are dropped too;
    SUFFIX and BITMAP must select every position of that run and none before it, so no position is left without a
    row.

    Args:
        data: the blob (``payloads.router_replay.data``), base64 text or bytes.
        rows_held: routing rows the open branch holds (positions ``[0, rows_held)``).
        num_tokens: the turn's sequence (prompt + completion); the blob's ``total_token_count`` must equal it.
        cfg: the run's fields (``routed_experts`` configured).

    Returns:
        ``[num_tokens - 1 - rows_held, num_layers, top_k]`` in ``cfg.routing_dtype``, positions
        ``[rows_held, num_tokens - 1)``.

    Raises:
        FieldError: naming the blob's field: not base64 or zstd; a short or foreign header (magic, version,
            mode, dtype, a uint16 blob without the little-endian flag); section lengths that do not add up;
            ``total_token_count != num_tokens``; matrices of another size than ``[num_layers, top_k]``;
            positions that do not cover ``[rows_held, num_tokens - 1)`` exactly; an id out of range or repeated.
    """
    what = "R3/v1 routing blob"
    num_layers, top_k = _routing_dims(cfg)
    mode, dtype, total, positions, matrices = _r3_sections(_r3_raw(data, what), what)
    if total != num_tokens:
        raise FieldError(f"{what}: total_token_count={total}: expected {num_tokens} (the turn's prompt + completion)")
    per_row = num_layers * top_k * dtype.itemsize
    if len(matrices) != positions.size * per_row:
        raise FieldError(f"{what}: {len(matrices)} matrix bytes for {positions.size} positions: expected "
                         f"{positions.size * per_row} ({dtype} [{num_layers}, {top_k}] per position)")
    rows = np.frombuffer(matrices, dtype).reshape(positions.size, num_layers, top_k)
    end = num_tokens - 1  # the last token's row comes with the next turn's prefill
    keep = (positions < end) & (positions >= (rows_held if mode == "ALL" else 0))
    rows, positions = rows[keep], positions[keep]
    if not np.array_equal(positions, np.arange(rows_held, max(end, rows_held))):
        span = f"from {int(positions[0])} to {int(positions[-1])}" if positions.size else "none"
        raise FieldError(f"{what}: {mode} selects {positions.size} positions below {end} ({span}): expected the run "
                         f"[{rows_held}, {end}) (the open branch holds {rows_held} rows; the row of the last "
                         f"position {end} comes with the next turn)")
    return _checked_rows(rows, cfg, what, first=rows_held)


def _r3_raw(data: str | bytes, what: str) -> bytes:
    """The decompressed blob: base64, then zstd (concatenated frames are decoded in order)."""
    try:
        compressed = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise FieldError(f"{what}: not base64 ({e})") from None
    try:
        return bytes(Zstd().decode(compressed))
    except RuntimeError as e:
        raise FieldError(f"{what}: not a zstd frame ({e})") from None


def _r3_sections(raw: bytes, what: str) -> tuple[str, np.dtype, int, np.ndarray, bytes]:
    """``(mode, dtype, total_token_count, selected positions int64 [n], matrix bytes)`` of a decompressed blob."""
    if len(raw) < R3_HEADER.size:
        raise FieldError(f"{what}: {len(raw)} bytes: expected at least the {R3_HEADER.size}-byte R3/v1 header")
    magic, version, mode_id, width, flags, total, replayed, start, selector_len, matrix_len = R3_HEADER.unpack_from(raw)
    if magic != b"R3V1" or version != 1 or mode_id not in _R3_MODES or width not in (1, 2) or (
            width == 2 and not flags & 1):
        raise FieldError(f"{what}: header magic={magic!r} version={version} selector_mode={mode_id} "
                         f"routing_dtype={width} flags={flags:#x}: expected b'R3V1', 1, 0-2 (ALL, SUFFIX, BITMAP), "
                         "1 (uint8) or 2 (uint16, with flag 0x01: little-endian)")
    if len(raw) != R3_HEADER.size + selector_len + matrix_len:
        raise FieldError(f"{what}: {len(raw)} bytes: expected {R3_HEADER.size + selector_len + matrix_len} (header, "
                         f"{selector_len} selector bytes, {matrix_len} matrix bytes)")
    mode = _R3_MODES[mode_id]
    selector = raw[R3_HEADER.size:R3_HEADER.size + selector_len]
    if mode == "ALL":
        positions = np.arange(total if replayed else 0, dtype=np.int64)
    elif mode == "SUFFIX":
        positions = np.arange(start, start + replayed, dtype=np.int64)
    else:
        bits = np.unpackbits(np.frombuffer(selector, np.uint8), bitorder="little")[:total]
        positions = np.flatnonzero(bits).astype(np.int64)
    if positions.size != replayed or (positions.size and positions[-1] >= total):
        raise FieldError(f"{what}: {mode} selects {positions.size} positions (up to {total} tokens): expected "
                         f"replayed_token_count={replayed} positions below total_token_count={total}")
    return mode, np.dtype("<u1" if width == 1 else "<u2"), total, positions, raw[R3_HEADER.size + selector_len:]


def _routing_dims(cfg: FieldsConfig) -> tuple[int, int]:
    """``(num_layers, top_k)`` of the run's ``routed_experts``."""
    if "routed_experts" not in cfg.registry() or cfg.num_layers is None or cfg.top_k is None:
        raise FieldError("routed_experts is not configured for this run: expected FieldsConfig with num_layers, "
                         "top_k and num_experts set")
    return cfg.num_layers, cfg.top_k


def _checked_rows(a: np.ndarray, cfg: FieldsConfig, what: str, *, first: int) -> np.ndarray:
    """New rows ``[n, num_layers, top_k]`` (any integer dtype) checked against ``routed_experts``' declaration and
    narrowed to ``cfg.routing_dtype``; ``first`` is the position of ``a[0]`` (named in errors)."""
    decl, trailing = FIELDS["routed_experts"], _routing_dims(cfg)
    if a.dtype.kind not in "iu" or a.ndim != 3 or a.shape[1:] != trailing:
        raise FieldError(f"{what} is {a.dtype} {list(a.shape)}: expected integer [rows, {trailing[0]}, {trailing[1]}]")
    problem = check_values(a, decl.checks, cfg.dims, decl.shape)
    if problem:
        raise FieldError(f"{what} (row 0 = position {first}): {problem}")
    return a.astype(cfg.routing_dtype)
