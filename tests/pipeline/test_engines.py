"""Engine adapters against recorded examples of each engine's wire format, kept through the real keep path."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from numcodecs import Zstd

from refpipe.pipeline.engines import (
    R3_HEADER,
    TurnRows,
    engine_routed_experts,
    r3_routing_rows,
    sglang_routed_experts,
    sglang_suffix_rows,
)
from refpipe.pipeline.fields import FieldsConfig, validate_branch
from refpipe.storage.errors import FieldError

L, K, E = 3, 2, 16
CFG = FieldsConfig(num_layers=L, top_k=K, num_experts=E, routing_rows="all_but_last")


def _routing(num_rows: int, seed: int = 0) -> np.ndarray:
    base = np.random.default_rng(seed).integers(0, E, (num_rows, L, 1))
    return ((base + np.arange(K)) % E).astype(np.int32)


def _sglang_wire(rows: np.ndarray) -> str:
    """What SGLang sends: base64 of the flattened int32 [rows, layers, top_k], little-endian."""
    return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")


def test_sglang_whole_sequence_decodes_and_keeps_with_all_but_last():
    p, c = 4, 5
    rows = _routing(p + c - 1)  # positions [0, seqlen - 1)
    decoded = sglang_routed_experts(_sglang_wire(rows), num_tokens=p + c, num_layers=L, top_k=K)
    assert decoded.dtype == np.dtype("<i4") and decoded.tobytes() == rows.tobytes()
    arrays, specs = validate_branch({"routed_experts": decoded}, CFG, num_prompt_tokens=p, num_completion_tokens=c,
                                    what="b")
    assert specs["routed_experts"].dtype == "|u1" and arrays["routed_experts"].shape == (p + c, L, K)
    assert arrays["routed_experts"][:-1].tolist() == rows.tolist()  # narrowed to uint8, values intact


def test_sglang_suffix_from_routed_experts_start_len_joins_the_earlier_turn():
    p, c, start = 6, 4, 5  # a second turn: the first 5 positions' rows came with the first turn
    whole = _routing(p + c - 1, seed=1)
    suffix = _sglang_wire(whole[start:])
    joined = sglang_routed_experts(suffix, num_tokens=p + c, num_layers=L, top_k=K, start_len=start,
                                   earlier=torch.from_numpy(whole[:start].astype(np.int64)))
    assert joined.tolist() == whole.tolist()


@pytest.mark.parametrize("kwargs,message", [
    ({"data": "not base64!"}, "SGLang routed_experts: not base64"),
    ({"data": _sglang_wire(_routing(7))},
     "SGLang routed_experts: 168 bytes: expected 8 rows of int32 [3, 2] (192 bytes: positions [0, 8) of 9 tokens; "
     "set routed_experts_start_len to what the request sent)"),
    ({"data": _sglang_wire(_routing(4)), "start_len": 4}, "from routed_experts_start_len=4: earlier holds None rows"),
])
def test_sglang_errors_name_the_rows_expected(kwargs, message):
    with pytest.raises(FieldError) as info:
        sglang_routed_experts(**{"num_tokens": 9, "num_layers": L, "top_k": K} | kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("engine,rows", [
    ("vLLM", torch.from_numpy(_routing(8).astype(np.int64))),  # on the worker: a CPU tensor of int64 ids
    ("TensorRT-LLM", _routing(8).astype(np.int16)),            # int16 [n - 1, L, K]
])
def test_t_minus_one_engines_keep_with_all_but_last(engine, rows):
    checked = engine_routed_experts(rows, num_tokens=9, engine=engine)
    arrays, _ = validate_branch({"routed_experts": checked}, CFG, num_prompt_tokens=4, num_completion_tokens=5,
                                what="b")
    assert arrays["routed_experts"][:8].tolist() == _routing(8).tolist()
    with pytest.raises(FieldError, match=r'has shape \[8, 3, 2\]: expected \[9, 3, 2\] \(tokens domain rows; P \+ C '
                                         r'- 1 rows, as engines return routing, need routing_rows = "all_but_last"'):
        validate_branch({"routed_experts": checked}, CFG.model_copy(update={"routing_rows": "all_tokens"}),
                        num_prompt_tokens=4, num_completion_tokens=5, what="b")
    with pytest.raises(FieldError, match=r'expected integer \[9, layers, top_k\] \(P \+ C - 1 rows of 10 tokens, kept '
                                         r'with FieldsConfig.routing_rows = "all_but_last"\)'):
        engine_routed_experts(rows, num_tokens=10, engine=engine)


# Per turn: a three-turn trace. Turn k's request has the whole context so far as its prompt; tokens after each
# turn: 7, 11, 16; the engine's rows of one request cover positions [0, P + C - 1).
TURNS = ((4, 3), (9, 2), (13, 3))  # (P, C) per request: turn 2's prompt adds 2 env tokens to turn 1's 7
WHOLE = _routing(15, seed=3)        # positions [0, 15): what a whole-sequence request over the last turn returns


def test_turn_rows_emit_exactly_the_rows_known_and_the_boundary_row_from_the_next_prefill():
    turns = TurnRows(CFG)
    emitted = []
    for p, c in TURNS:
        engine_rows = torch.from_numpy(WHOLE[:p + c - 1].astype(np.int64))  # the request's own P + C - 1 rows
        emitted.append(turns.turn(engine_rows, num_prompt_tokens=p, num_completion_tokens=c))
    assert [len(e) for e in emitted] == [6, 4, 5] and [e.dtype for e in emitted] == [np.dtype(np.uint8)] * 3
    assert emitted[1][0].tolist() == WHOLE[6].tolist()  # turn 1's last token: its row is turn 2's first new row
    assert np.concatenate(emitted).tolist() == WHOLE.tolist()
    assert (turns.num_tokens, turns.rows_held, turns.turns) == (16, 15, 3)
    assert turns.close() == 1
    arrays, _ = validate_branch({"routed_experts": np.concatenate(emitted)}, CFG, num_prompt_tokens=13,
                                num_completion_tokens=3, what="b")
    assert arrays["routed_experts"].shape == (16, L, K) and arrays["routed_experts"][:15].tolist() == WHOLE.tolist()


def test_turn_rows_take_a_request_whose_rows_start_at_the_pending_row():
    turns = TurnRows(CFG)
    turns.turn(WHOLE[:6], num_prompt_tokens=4, num_completion_tokens=3)
    new = turns.turn(WHOLE[6:10], num_prompt_tokens=9, num_completion_tokens=2, first_row=6)
    assert new.tolist() == WHOLE[6:10].tolist()


@pytest.mark.parametrize("rows,first_row,prompt,message", [
    (WHOLE[7:10], 7, 9, "vLLM routed_experts of turn 2: rows start at position 7: expected rows from position 6 on "
                        "(the row of turn 1's last token, position 6, comes only from this turn's prefill)"),
    (WHOLE[:9], 0, 9, "vLLM routed_experts of turn 2 has shape [9, 3, 2]: expected [10, num_layers, top_k] "
                      "(positions [0, 10): P + C - 1 rows of 11 tokens from first_row=0)"),
    (np.concatenate([WHOLE[:10], np.zeros((1, L, K), np.int32)]), 0, 9,  # a dense [P + C] layout: a zero last row
     "vLLM routed_experts of turn 2 has shape [11, 3, 2]: expected [10, num_layers, top_k] (positions [0, 10): "
     "P + C - 1 rows of 11 tokens from first_row=0)"),
    (WHOLE[:5], 0, 5, "vLLM routed_experts of turn 2: prompt of 5 tokens: expected at least the 7 tokens of the "
                      "trace so far (a prompt that extends it)"),
    (np.where(np.arange(10)[:, None, None] == 8, 16, WHOLE[:10]), 0, 9,
     "vLLM routed_experts of turn 2 (row 0 = position 6): row 2 [num_layers 0, top_k 0] value 16: expected >= 0, "
     "< num_experts=16"),
])
def test_turn_rows_refuse_a_turn_that_leaves_a_row_unknown_or_bad(rows, first_row, prompt, message):
    turns = TurnRows(CFG)
    turns.turn(WHOLE[:6], num_prompt_tokens=4, num_completion_tokens=3)
    with pytest.raises(FieldError) as info:
        turns.turn(rows, num_prompt_tokens=prompt, num_completion_tokens=11 - prompt, first_row=first_row)
    assert str(info.value) == message
    assert (turns.num_tokens, turns.turns) == (7, 1)  # a refused turn changes nothing


def test_turn_rows_of_the_first_turn_start_at_position_0():
    with pytest.raises(FieldError) as info:
        TurnRows(CFG).turn(WHOLE[2:6], num_prompt_tokens=4, num_completion_tokens=3, first_row=2)
    assert str(info.value) == ("vLLM routed_experts of turn 1: rows start at position 2: expected rows from position 0 "
                               "on (the first turn's rows start at the sequence's start)")


def test_turn_rows_after_close_and_an_empty_trace():
    turns = TurnRows(CFG, engine="TensorRT-LLM")
    assert turns.close() == 0
    with pytest.raises(FieldError, match=r"^TensorRT-LLM routed_experts of turn 1: the trace was closed after turn 0: "
                                         r"expected no further turns$"):
        turns.turn(WHOLE[:6].astype(np.int16), num_prompt_tokens=4, num_completion_tokens=3)


def test_sglang_suffix_rows_per_turn_from_routed_experts_start_len():
    first = sglang_suffix_rows(_sglang_wire(WHOLE[:6]), start_len=0, rows_held=0, num_tokens=7, cfg=CFG)
    second = sglang_suffix_rows(_sglang_wire(WHOLE[6:10]), start_len=6, rows_held=6, num_tokens=11, cfg=CFG)
    assert first.dtype == second.dtype == np.uint8
    assert np.concatenate([first, second]).tolist() == WHOLE[:10].tolist()


@pytest.mark.parametrize("rows,start_len,message", [
    (WHOLE[5:10], 5, "SGLang routed_experts from routed_experts_start_len=5: the open branch holds 6 rows: expected a "
                     "suffix from position 6 (send routed_experts_start_len=6)"),
    (WHOLE[6:9], 6, "SGLang routed_experts: 72 bytes: expected 4 rows of int32 [3, 2] (96 bytes: positions [6, 10) "
                    "of 11 tokens; set routed_experts_start_len to what the request sent)"),
    (np.where(np.arange(4)[:, None, None] == 3, -1, WHOLE[6:10]), 6,
     "SGLang routed_experts (row 0 = position 6): row 3 [num_layers 0, top_k 0] value -1: expected >= 0, "
     "< num_experts=16"),
    (np.concatenate([WHOLE[6:9], [[[1, 1], [2, 3], [4, 5]]]]).astype(np.int32), 6,
     "SGLang routed_experts (row 0 = position 6): row 3 [num_layers 0] holds [1, 1]: expected 2 distinct ids "
     "(no router picks one id twice for a token)"),
])
def test_sglang_suffix_rows_errors_name_the_position(rows, start_len, message):
    with pytest.raises(FieldError) as info:
        sglang_suffix_rows(_sglang_wire(rows), start_len=start_len, rows_held=6, num_tokens=11, cfg=CFG)
    assert str(info.value) == message


def _r3_blob(mode: int, total: int, replayed: int, start: int, selector: bytes, matrices: bytes, *, width: int = 1,
             flags: int = 1, magic: bytes = b"R3V1", matrix_byte_length: int | None = None) -> str:
    """An R3/v1 blob written byte by byte from the public reader's layout (eval-protocol/python-sdk
    eval_protocol/adapters/r3_deserializer.py): a 32-byte little-endian header, selector, matrices; zstd; base64."""
    header = (magic + bytes([1, mode, width, flags]) + total.to_bytes(4, "little") + replayed.to_bytes(4, "little")
              + start.to_bytes(4, "little") + len(selector).to_bytes(4, "little")
              + (len(matrices) if matrix_byte_length is None else matrix_byte_length).to_bytes(8, "little"))
    return base64.b64encode(Zstd().encode(header + selector + matrices)).decode("ascii")


def test_r3_header_layout_is_the_recorded_one():
    raw = Zstd().decode(base64.b64decode(_r3_blob(1, 11, 4, 6, b"", WHOLE[6:10].astype(np.uint8).tobytes())))
    assert bytes(raw[:32]).hex() == "52335631" "01010101" "0b000000" "04000000" "06000000" "00000000" "1800000000000000"
    assert R3_HEADER.size == 32


def test_r3_suffix_all_and_bitmap_give_the_rows_the_branch_lacks():
    u8 = WHOLE.astype(np.uint8)
    suffix = _r3_blob(1, 11, 4, 6, b"", u8[6:10].tobytes())
    bitmap = _r3_blob(2, 11, 4, 0, bytes([0b11000000, 0b00000011]), u8[6:10].tobytes())  # positions 6, 7 | 8, 9
    for blob in (suffix, bitmap):
        rows = r3_routing_rows(blob, rows_held=6, num_tokens=11, cfg=CFG)
        assert rows.dtype == np.uint8 and rows.tolist() == WHOLE[6:10].tolist()
    whole = _r3_blob(0, 11, 11, 0, b"", u8[:11].tobytes())  # ALL: a row for every one of the 11 positions
    assert r3_routing_rows(whole, rows_held=6, num_tokens=11, cfg=CFG).tolist() == WHOLE[6:10].tolist()
    assert r3_routing_rows(whole, rows_held=0, num_tokens=11, cfg=CFG).tolist() == WHOLE[:10].tolist()


def test_r3_modes_agree_that_the_last_tokens_row_comes_with_the_next_turn():
    u8 = WHOLE.astype(np.uint8)
    blobs = {"ALL": _r3_blob(0, 11, 11, 0, b"", u8[:11].tobytes()),
             "SUFFIX": _r3_blob(1, 11, 5, 6, b"", u8[6:11].tobytes()),  # selects the last position 10 too
             "BITMAP": _r3_blob(2, 11, 5, 0, bytes([0b11000000, 0b00000111]), u8[6:11].tobytes())}
    for mode, blob in blobs.items():
        rows = r3_routing_rows(blob, rows_held=6, num_tokens=11, cfg=CFG)
        assert rows.tolist() == WHOLE[6:10].tolist(), mode
    nxt = _r3_blob(0, 15, 15, 0, b"", u8[:15].tobytes())  # the next turn's prefill routes position 10
    assert r3_routing_rows(nxt, rows_held=10, num_tokens=15, cfg=CFG).tolist() == WHOLE[10:14].tolist()


def test_r3_blob_compressed_in_chunks_is_read_whole():
    raw = Zstd().decode(base64.b64decode(_r3_blob(1, 11, 4, 6, b"", WHOLE[6:10].astype(np.uint8).tobytes())))
    chunked = Zstd().encode(bytes(raw[:20])) + Zstd().encode(bytes(raw[20:]))  # two frames, cut inside the header
    rows = r3_routing_rows(base64.b64encode(chunked), rows_held=6, num_tokens=11, cfg=CFG)
    assert rows.tolist() == WHOLE[6:10].tolist()


def test_r3_uint16_rows_narrow_to_the_runs_routing_dtype():
    cfg = CFG.model_copy(update={"num_experts": 512})
    ids = np.array([[[300, 511], [0, 1], [2, 257]]], dtype="<u2")
    rows = r3_routing_rows(_r3_blob(1, 3, 1, 1, b"", ids.tobytes(), width=2), rows_held=1, num_tokens=3, cfg=cfg)
    assert rows.dtype == np.uint16 and rows.tolist() == ids.tolist()
    with pytest.raises(FieldError, match=r"^R3/v1 routing blob \(row 0 = position 1\): row 0 \[num_layers 0, top_k 0\] "
                                         r"value 300: expected >= 0, < num_experts=256$"):
        r3_routing_rows(_r3_blob(1, 3, 1, 1, b"", ids.tobytes(), width=2), rows_held=1, num_tokens=3,
                        cfg=CFG.model_copy(update={"num_experts": 256}))


@pytest.mark.parametrize("blob,message", [
    (_r3_blob(1, 11, 4, 5, b"", bytes(24)), "R3/v1 routing blob: SUFFIX selects 4 positions below 10 (from 5 to 8): "
                                            "expected the run [6, 10) (the open branch holds 6 rows; the row of the "
                                            "last position 10 comes with the next turn)"),
    (_r3_blob(2, 11, 3, 0, bytes([0b01000000, 0b00000011]), bytes(18)),  # positions 6, 8, 9: no row for 7
     "R3/v1 routing blob: BITMAP selects 3 positions below 10 (from 6 to 9): expected the run [6, 10)"),
    (_r3_blob(1, 11, 3, 6, b"", bytes(18)), "R3/v1 routing blob: SUFFIX selects 3 positions below 10 (from 6 to 8): "
                                            "expected the run [6, 10)"),  # no row for 9
    (_r3_blob(1, 12, 4, 6, b"", bytes(24)), "R3/v1 routing blob: total_token_count=12: expected 11 (the turn's "
                                            "prompt + completion)"),
    (_r3_blob(1, 11, 4, 6, b"", bytes(20)), "R3/v1 routing blob: 20 matrix bytes for 4 positions: expected 24 (uint8 "
                                            "[3, 2] per position)"),
    (_r3_blob(1, 11, 4, 6, b"", bytes(18), matrix_byte_length=24),
     "R3/v1 routing blob: 50 bytes: expected 56 (header, 0 selector bytes, 24 matrix bytes)"),
    (_r3_blob(1, 11, 0, 6, b"", bytes(6)), "R3/v1 routing blob: 6 matrix bytes for 0 positions: expected 0 (uint8 "
                                           "[3, 2] per position)"),
    (_r3_blob(1, 11, 4, 9, b"", bytes(24)), "R3/v1 routing blob: SUFFIX selects 4 positions (up to 11 tokens): "
                                            "expected replayed_token_count=4 positions below total_token_count=11"),
    (_r3_blob(1, 11, 4, 6, b"", bytes(48), width=2, flags=0),
     "R3/v1 routing blob: header magic=b'R3V1' version=1 selector_mode=1 routing_dtype=2 flags=0x0: expected "
     "b'R3V1', 1, 0-2 (ALL, SUFFIX, BITMAP), 1 (uint8) or 2 (uint16, with flag 0x01: little-endian)"),
    (_r3_blob(1, 11, 4, 6, b"", bytes(24), magic=b"R3V2"), "R3/v1 routing blob: header magic=b'R3V2'"),
    (base64.b64encode(b"not zstd").decode(), "R3/v1 routing blob: not a zstd frame"),
    ("@@", "R3/v1 routing blob: not base64"),
])
def test_r3_errors_name_the_blob_and_what_was_expected(blob, message):
    with pytest.raises(FieldError) as info:
        r3_routing_rows(blob, rows_held=6, num_tokens=11, cfg=CFG)
    assert str(info.value).startswith(message)
