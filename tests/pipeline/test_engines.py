"""Engine adapters against recorded examples of each engine's wire format, kept through the real keep path."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from refpipe.pipeline.engines import engine_routed_experts, sglang_routed_experts
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
