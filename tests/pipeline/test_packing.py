"""Packing: exact small cases, and invariants over 320 seeded random steps."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.packing import (
    PADDING_ENV_NAME,
    assign_to_ranks,
    balanced_packer,
    first_fit_decreasing,
    first_fit_packer,
    make_dummy,
    pack_step,
    step_contents,
)
from refpipe.pipeline.samples import BranchResult, Episode, build_sample
from refpipe.pipeline.step_header import STREAMS
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef, layout_arrays
from refpipe.storage.errors import PackingError
from refpipe.storage.layout import node_key

RUN_URI = "file:///runs/run_1"
FIELDS = FieldsConfig(num_layers=2, top_k=2, num_experts=8, logprobs_k=3)


def _ref(branch_id: str, num_prompt: int, num_completion: int, routing: bool) -> PayloadRef:
    arrays = {"topk_ids": ArraySpec("<i4", (num_completion, 3), "completion", (0,))}
    if routing:
        arrays = {"routed_experts": ArraySpec("|u1", (num_prompt + num_completion, 2, 2), "tokens", (0,))}
    return PayloadRef(uri=f"{RUN_URI}/{node_key(branch_id)}", branch_id=branch_id, num_prompt_tokens=num_prompt,
                      num_completion_tokens=num_completion, arrays=arrays, nbytes=layout_arrays(arrays)[1] + 4,
                      checksum=0)


def _sample(rng, i: int, num_prompt: int, num_completion: int, kind: str, seq_len: int):
    """kind: "routing", "side" (side channels without routing) or "none" (no arrays)."""
    ref = None if kind == "none" else _ref(f"b{i}", num_prompt, num_completion, kind == "routing")
    branch = BranchResult(rng.integers(0, 50, num_prompt, dtype=np.int32),
                          rng.integers(0, 50, num_completion, dtype=np.int32),
                          -rng.random(num_completion, dtype=np.float32), 1.0, 0, ref)
    e = Episode(f"e{i}", "g", f"env{i % 3}", 1.0, [branch])
    return build_sample(e, branch, reward=float(i), advantage=float(i % 5) - 2, seq_len=seq_len)


def _random_step(seed: int):
    rng = np.random.default_rng(seed)
    seq_len, dp = int(rng.integers(4, 65)), int(rng.integers(1, 9))
    kinds = rng.choice(["routing", "side", "none"], size=3, replace=True)[: int(rng.integers(1, 4))]
    samples = []
    for i in range(int(rng.integers(1, 41))):
        num_prompt = int(rng.integers(1, seq_len))
        samples.append(_sample(rng, i, num_prompt, int(rng.integers(1, 2 * seq_len)), str(rng.choice(kinds)), seq_len))
    return samples, seq_len, dp


@pytest.mark.parametrize("packer, seed", [(first_fit_packer, s) for s in range(320)]
                         + [(balanced_packer, s) for s in range(160)])
def test_packing_invariants(packer, seed):
    samples, seq_len, dp = _random_step(seed)
    packed = pack_step(samples, seq_len=seq_len, dp_world_size=dp, packer=packer)
    header, streams = step_contents(packed, step=seed, run_uri=RUN_URI, seq_len=seq_len, dp_world_size=dp,
                                    fields=FIELDS, metrics={})  # StepHeader validation: counts, padding, routing
    real = [mb for mb in packed if not mb.is_dummy]
    # every sample placed exactly once, every micro batch within seq_len
    assert sorted(id(s) for mb in real for s in mb.samples) == sorted(id(s) for s in samples)
    assert all(0 < mb.num_tokens <= seq_len for mb in packed)
    # equal micro batches per DP rank; fewer than dp_world_size dummies; ordered by (rank, index)
    per_rank = Counter(mb.dp_rank for mb in packed)
    assert set(per_rank) == set(range(dp)) and len(set(per_rank.values())) == 1
    assert [(mb.dp_rank, mb.index) for mb in packed] == sorted((r, i) for r in range(dp) for i in range(per_rank[0]))
    # routing and non-routing never share a micro batch
    for mb in real:
        assert {s.has_routing for s in mb.samples} == {mb.has_routing}
    if packer is first_fit_packer:  # the fewest micro batches: at most one per kind is half full or less
        assert per_rank[0] == math.ceil(len(real) / dp) and len(packed) - len(real) < dp
        for routing in (True, False):
            assert sum(mb.num_tokens * 2 <= seq_len for mb in real if mb.has_routing == routing) <= 1
    else:  # largest first to the least-loaded rank: ranks' real tokens differ by at most the longest sample
        load = [sum(mb.num_tokens for mb in real if mb.dp_rank == r) for r in range(dp)]
        assert max(load) - min(load) <= max(s.num_tokens for s in samples)
    # streams and cu_seqlens: the concatenation of the samples, in order
    assert len(header.micro_batches) == len(packed) and set(streams) == {(mb.dp_rank, mb.index) for mb in packed}
    for mb, record in zip(packed, header.micro_batches):
        cu = record.cu_seqlens()
        assert cu[0] == 0 and cu[-1] == mb.num_tokens == record.num_tokens and cu.dtype == np.int32
        assert np.all(np.diff(cu) > 0) and record.num_padding_tokens == seq_len - mb.num_tokens
        for name in STREAMS:
            assert streams[(mb.dp_rank, mb.index)][name].tobytes() == b"".join(
                getattr(s, name).tobytes() for s in mb.samples)
    _check_refs(samples, packed, header)


def _check_refs(samples, packed, header):
    """Every kept slice accounted once, owned by its sample's DP rank; borrows point at owned refs."""
    real = [mb for mb in packed if not mb.is_dummy]
    owner_of = {s.payload.ref.branch_id: mb.dp_rank for mb in real for s in mb.samples if s.payload}
    assert [r.branch_id for r in header.refs] == list(owner_of) and header.owners == list(owner_of.values())
    step_routes = any(s.has_routing for s in samples)
    for mb, record in zip(packed, header.micro_batches):
        for s, seq in zip(mb.samples, record.sequences):
            assert seq.borrowed == (mb.is_dummy and step_routes)
            assert seq.ref == (None if s.payload is None else [r.branch_id for r in header.refs].index(
                s.payload.ref.branch_id))
            if mb.is_dummy:
                assert not s.loss_mask.any() and not s.advantages.any() and seq.env_name == PADDING_ENV_NAME
                assert mb.has_routing == step_routes
            if seq.borrowed:
                lender = next(x for m in real for x in m.samples if x.payload and x.payload.ref == s.payload.ref)
                assert lender.has_routing and seq.num_tokens <= lender.payload.num_tokens


def test_first_fit_decreasing_exact_bins():
    assert first_fit_decreasing(np.array([5, 4, 3, 3, 2, 2, 1]), 8) == [[0, 2], [1, 3, 6], [4, 5]]
    assert first_fit_decreasing(np.array([1, 8, 2]), 8) == [[1], [2, 0]]
    assert first_fit_decreasing(np.array([], np.int64), 8) == []


def test_assign_to_ranks_balances_tokens_within_equal_counts():
    assert assign_to_ranks(np.array([10, 9, 1, 1]), 2) == [[0, 3], [1, 2]]
    assert assign_to_ranks(np.array([8, 7, 6, 5, 4, 3, 2, 1]), 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert assign_to_ranks(np.array([3]), 3) == [[0], [], []]


def test_dummies_of_a_step_without_routing_carry_no_ref():
    rng = np.random.default_rng(0)
    samples = [_sample(rng, 0, 3, 5, "side", 16), _sample(rng, 1, 2, 2, "none", 16)]
    packed = pack_step(samples, seq_len=16, dp_world_size=3, packer=first_fit_packer)
    header, streams = step_contents(packed, step=0, run_uri=RUN_URI, seq_len=16, dp_world_size=3, fields=FIELDS,
                                    metrics={})
    assert [(mb.dp_rank, mb.is_dummy, mb.num_tokens) for mb in packed] == [(0, False, 12), (1, True, 4), (2, True, 4)]
    assert [s.ref for mb in header.micro_batches for s in mb.sequences] == [0, None, None, None]
    assert header.owners == [0] and not streams[(1, 0)]["loss_mask"].any()
    assert streams[(2, 0)]["input_ids"].tobytes() == samples[1].input_ids.tobytes()


def test_dummy_borrows_the_shortest_routing_sample_of_its_own_rank_first():
    rng = np.random.default_rng(1)
    samples = [_sample(rng, i, 2, n, "routing", 10) for i, n in enumerate((8, 8, 8, 4, 3))]
    packed = pack_step(samples, seq_len=10, dp_world_size=2)
    dummies = [(mb.dp_rank, mb.samples[0].payload.ref.branch_id) for mb in packed if mb.is_dummy]
    owners = {s.payload.ref.branch_id: mb.dp_rank for mb in packed if not mb.is_dummy for s in mb.samples}
    assert len(dummies) == 1 and owners[dummies[0][1]] == dummies[0][0]
    dummy = make_dummy(samples[4], borrow=True)
    assert dummy.payload == samples[4].payload and dummy.input_ids.tobytes() == samples[4].input_ids.tobytes()


def test_packing_errors():
    rng = np.random.default_rng(2)
    with pytest.raises(PackingError, match="no samples to pack"):
        pack_step([], seq_len=8, dp_world_size=1)
    long = _sample(rng, 7, 4, 20, "none", 24)
    with pytest.raises(PackingError, match=r"samples of episodes \['e7'\] are longer than seq_len=16"):
        pack_step([long], seq_len=16, dp_world_size=1)
    twice = _sample(rng, 1, 2, 3, "routing", 16)
    packed = pack_step([twice, twice], seq_len=16, dp_world_size=1)
    with pytest.raises(PackingError, match=rf"chunk {RUN_URI}/{node_key('b1')} is used by two samples"):
        step_contents(packed, step=0, run_uri=RUN_URI, seq_len=16, dp_world_size=1, fields=FIELDS, metrics={})


@pytest.mark.parametrize("kind, fields, message", [
    ("routing", FieldsConfig(num_layers=4, top_k=2, num_experts=8),
     "array 'routed_experts' has trailing shape [2, 2]: expected [4, 2] from fields"),
    ("routing", FieldsConfig(num_layers=2, top_k=2), "array 'routed_experts' is not a field configured in fields"),
    ("side", FieldsConfig(num_layers=2, top_k=2, num_experts=8), "array 'topk_ids' is not a field configured"),
])
def test_refs_disagreeing_with_the_run_fields_are_packing_errors(kind, fields, message):
    packed = pack_step([_sample(np.random.default_rng(3), 4, 2, 3, kind, 16)], seq_len=16, dp_world_size=1)
    with pytest.raises(PackingError) as e:
        step_contents(packed, step=5, run_uri=RUN_URI, seq_len=16, dp_world_size=1, fields=fields, metrics={})
    assert str(e.value).startswith(f"step 5: ref 0 ({RUN_URI}/{node_key('b4')}): {message}")
    header, _ = step_contents(packed, step=5, run_uri=RUN_URI, seq_len=16, dp_world_size=1, fields=FIELDS, metrics={})
    assert header.fields == FIELDS


def test_balanced_packer_gives_each_dp_rank_comparable_work():
    """8 samples of 118 tokens in all: first fit packs them into one micro batch, so DP rank 1 trains only a padding
    copy of the shortest sample; the balanced default splits them 59 / 59."""
    rng = np.random.default_rng(4)
    samples = [_sample(rng, i, 4, n - 4, "routing", 128) for i, n in enumerate((20, 18, 16, 15, 14, 12, 12, 11))]

    def per_rank(packed):
        return [[(mb.num_tokens, mb.is_dummy) for mb in packed if mb.dp_rank == r] for r in (0, 1)]

    assert per_rank(pack_step(samples, seq_len=128, dp_world_size=2, packer=first_fit_packer)) == [
        [(118, False)], [(11, True)]]
    balanced = pack_step(samples, seq_len=128, dp_world_size=2)
    assert per_rank(balanced) == [[(59, False)], [(59, False)]]
    assert [[s.num_tokens for s in mb.samples] for mb in balanced] == [[20, 15, 12, 12], [18, 16, 14, 11]]
    # a rank without a sample of its own (fewer samples than ranks) trains a borrowing dummy
    three = pack_step(samples[:3], seq_len=128, dp_world_size=4)
    assert [(mb.dp_rank, mb.num_tokens, mb.is_dummy) for mb in three] == [
        (0, 20, False), (1, 18, False), (2, 16, False), (3, 16, True)]
    assert three[3].samples[0].payload == samples[2].payload


def test_a_packer_breaking_its_contract_is_a_packing_error():
    rng = np.random.default_rng(5)
    samples = [_sample(rng, i, 2, 3, kind, 16) for i, kind in enumerate(("routing", "none", "none"))]
    cases = [(lambda s, **_: [[list(s)]], r"1 lists of micro batches: expected one per DP rank \(2\)"),
             (lambda s, **_: [[[s[0]]], [[s[1]]]], r"2 samples placed: expected each of the 3 samples exactly once"),
             (lambda s, **_: [[[s[0], s[1]]], [[s[2]]]], r"dp_rank=0 micro batch 0: expected 1..16 tokens of samples "
                                                         r"that all carry routed_experts or none does"),
             (lambda s, **_: [[[s[0]], []], [[s[1], s[2]]]], r"dp_rank=0 micro batch 1: expected 1..16 tokens")]
    for packer, message in cases:
        with pytest.raises(PackingError, match=r"^packer '<lambda>': " + message):
            pack_step(samples, seq_len=16, dp_world_size=2, packer=packer)
