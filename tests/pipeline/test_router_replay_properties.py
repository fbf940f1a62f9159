"""One property per public router-replay bug class, each with its exact outcome (docs/fields.md, Value checks).

Every case goes through the real checks (``validate_branch`` at keep; the padding rule and row ids the
trainer's assembly uses), on shapes and values hypothesis draws.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refpipe.pipeline.field_decl import strided_rows
from refpipe.pipeline.fields import FieldsConfig, validate_branch
from refpipe.pipeline.step_header import MicroBatchRecord, SequenceRecord
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.errors import FieldError
from refpipe.storage.layout import node_key
from refpipe.trainer.layout import field_row_ids

FAST = settings(max_examples=40, deadline=None)
shapes = st.tuples(st.integers(0, 6), st.integers(1, 8), st.integers(1, 3), st.integers(1, 4))  # P, C, L, K


def _cfg(layers: int, top_k: int, experts: int = 16, **kw) -> FieldsConfig:
    return FieldsConfig(num_layers=layers, top_k=top_k, num_experts=experts, **kw)


def _routing(rows: int, layers: int, top_k: int, experts: int = 16, seed: int = 0, dtype=np.int32) -> np.ndarray:
    base = np.random.default_rng(seed).integers(0, experts, (rows, layers, 1))
    return ((base + np.arange(top_k)) % experts).astype(dtype)


def _keep(routing, cfg, p, c):
    return validate_branch({"routed_experts": routing}, cfg, num_prompt_tokens=p, num_completion_tokens=c, what="b")


@FAST
@given(shapes, st.integers(1, 5))
def test_missing_final_row_at_a_multi_turn_boundary(shape, turn_tokens):
    """Turn 2's prompt holds turn 1 and a tool reply; the engine returns P + C - 1 rows. Without
    ``routing_rows = "all_but_last"`` that is refused naming the setting; with it, the given rows are kept
    as they are and only row P + C - 1 comes from the padding rule."""
    p, c, layers, top_k = shape
    p += turn_tokens
    rows = _routing(p + c - 1, layers, top_k)
    with pytest.raises(FieldError, match=r'P \+ C - 1 rows, as engines return routing, need routing_rows = '
                                         r'"all_but_last"'):
        _keep(rows, _cfg(layers, top_k), p, c)
    arrays, _ = _keep(rows, _cfg(layers, top_k, routing_rows="all_but_last"), p, c)
    kept = arrays["routed_experts"]
    assert kept[:-1].tolist() == rows.tolist()
    assert kept[-1].tolist() == strided_rows(p + c, (layers, top_k), 16, np.uint8)[-1].tolist()


@FAST
@given(shapes, st.integers(1, 4))
def test_tokens_truncated_but_rows_not(shape, cut):
    """The env truncated the completion to C - cut tokens but passed every routing row: refused, naming both counts."""
    p, c, layers, top_k = shape
    c += cut
    with pytest.raises(FieldError) as info:
        _keep(_routing(p + c, layers, top_k), _cfg(layers, top_k), p, c - cut)
    assert f"has shape [{p + c}, {layers}, {top_k}]: expected [{p + c - cut}, {layers}, {top_k}]" in str(info.value)


@FAST
@given(st.integers(1, 4), st.integers(1, 8), st.integers(1, 40), st.integers(0, 64))
def test_constant_pad_fill_is_strided(layers, top_k, pad_rows, extra_experts):
    """Padding never sends every pad token to experts 0..k-1: pad row t slot k of layer l routes to
    (t * K + l + k) % E, distinct within each row, and rows differ from the constant fill once E > K."""
    experts = top_k + extra_experts
    rows = strided_rows(pad_rows, (layers, top_k), experts, np.uint16)
    t, l, k = np.meshgrid(np.arange(pad_rows), np.arange(layers), np.arange(top_k), indexing="ij")
    assert rows.tolist() == ((t * top_k + l + k) % experts).tolist()
    assert all(len(set(r)) == top_k for r in rows.reshape(-1, top_k).tolist())
    assert set(rows.ravel().tolist()) == set(range(min(experts, pad_rows * top_k + layers - 1)))  # spread over ids
    if pad_rows > 1 and experts > top_k:
        assert rows[1, 0].tolist() != list(range(top_k))  # never the constant fill 0..K-1


@FAST
@given(shapes, st.data())
def test_partially_padded_rows_are_refused(shape, data):
    """An engine's "no expert" -1 inside a row ([2, -1, -1]): refused naming the first such row, layer, slot."""
    p, c, layers, top_k = shape
    rows = _routing(p + c, layers, top_k)
    r = data.draw(st.integers(0, p + c - 1))
    l = data.draw(st.integers(0, layers - 1))
    first = data.draw(st.integers(0, top_k - 1))
    rows[r, l, first:] = -1
    with pytest.raises(FieldError) as info:
        _keep(rows, _cfg(layers, top_k), p, c)
    assert str(info.value) == (f"b: field 'routed_experts': row {r} [num_layers {l}, top_k {first}] value -1: "
                               "expected >= 0, < num_experts=16")


@FAST
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=4), st.integers(0, 3))
def test_prompt_rows_sit_at_their_own_positions(seqs, padding):
    """Prompt rows are aligned to their tokens (never left- or right-shifted by another sequence or padding):
    prompt row r of sequence s belongs to packed position start_s + r, every other position to no row."""
    refs = [PayloadRef(uri=f"file:///r/run/{node_key(f'b{i}')}", branch_id=f"b{i}", num_prompt_tokens=p,
                       num_completion_tokens=c, nbytes=4 + 64, checksum=0,
                       arrays={"f": ArraySpec("|u1", (p,), "prompt", (0,))}) for i, (p, c) in enumerate(seqs)]
    mb = MicroBatchRecord(dp_rank=0, index=0, num_padding_tokens=padding, has_routing=False,
                          sequences=[SequenceRecord(num_tokens=p + c, env_name="e", ref=i)
                                     for i, (p, c) in enumerate(seqs)])
    cu = np.concatenate([[0], np.cumsum([p for p, _ in seqs])]).astype(np.int32)
    total = sum(p + c for p, c in seqs)
    got = field_row_ids("prompt", mb, refs, cu, total + padding)
    want = []
    for s, (p, c) in enumerate(seqs):
        want += [int(cu[s]) + r for r in range(p)] + [-1] * c
    assert got.tolist() == want + [-1] * padding


@FAST
@given(shapes, st.integers(1, 2))
def test_layer_count_mismatch_is_refused(shape, mtp_layers):
    """Routing recorded with MTP layers (L + 1) for a model replaying L: refused naming both shapes."""
    p, c, layers, top_k = shape
    with pytest.raises(FieldError) as info:
        _keep(_routing(p + c, layers + mtp_layers, top_k), _cfg(layers, top_k), p, c)
    assert (f"has shape [{p + c}, {layers + mtp_layers}, {top_k}]: expected [{p + c}, {layers}, {top_k}]"
            in str(info.value))


@FAST
@given(st.integers(2, 1024), st.integers(1, 8), st.sampled_from([np.int32, np.int64, np.uint16]))
def test_more_than_256_experts_never_overflow_uint8(experts, top_k, dtype):
    """Wide ids are stored in the narrowest dtype that holds every expert id (uint8 up to 256, uint16 above;
    a uint16 input as it is), values intact; an id >= num_experts is refused, never wrapped."""
    top_k = min(top_k, experts)
    rows = _routing(6, 2, top_k, experts, dtype=dtype)
    rows[5, 1] = (np.arange(top_k) + experts - top_k)  # the highest ids
    arrays, specs = _keep(rows, _cfg(2, top_k, experts), 2, 4)
    assert specs["routed_experts"].dtype == ("|u1" if experts <= 256 and dtype != np.uint16 else "<u2")
    assert arrays["routed_experts"].tolist() == rows.tolist()
    rows[0, 0, 0] = experts
    with pytest.raises(FieldError, match=rf"row 0 \[num_layers 0, top_k 0\] value {experts}: expected >= 0, "
                                         rf"< num_experts={experts}$"):
        _keep(rows, _cfg(2, top_k, experts), 2, 4)


@FAST
@given(shapes, st.integers(2, 5), st.booleans())
def test_a_short_tail_is_never_treated_as_complete(shape, missing, all_but_last):
    """Rows shorter than the tokens (by 2 or more; by 1 without all_but_last) are refused, never padded."""
    p, c, layers, top_k = shape
    c += missing
    cfg = _cfg(layers, top_k, routing_rows="all_but_last" if all_but_last else "all_tokens")
    with pytest.raises(FieldError) as info:
        _keep(_routing(p + c - missing, layers, top_k), cfg, p, c)
    expected_rows = p + c - 1 if all_but_last else p + c
    assert f"has shape [{p + c - missing}, {layers}, {top_k}]: expected [{expected_rows}, " in str(info.value)
