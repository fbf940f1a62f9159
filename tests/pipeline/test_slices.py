"""The per-sample slice: its wire form is small, round-trips, and resolves only against the ref it sliced."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from refpipe.pipeline.slices import PayloadSlice, SliceId, ref_digest
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef, layout_arrays
from refpipe.storage.errors import SliceError
from refpipe.storage.layout import draw_branch_id, node_key
from tests.pipeline.orchestrator_helpers import FIELDS, branch, make_keeper


def _ref(branch_id: str, num_tokens: int = 4096, checksum: int = 7) -> PayloadRef:
    """A ref of 4 fields over ``num_tokens`` tokens (16 prompt), every block crc filled in, as keep returns."""
    c = num_tokens - 16
    blocks = lambda rows: tuple(range(3_000_000_000, 3_000_000_000 + -(-rows // 512)))  # noqa: E731
    arrays = {"routed_experts": ArraySpec("|u1", (num_tokens, 48, 8), "tokens", blocks(num_tokens)),
              "topk_ids": ArraySpec("<i4", (c, 20), "completion", blocks(c)),
              "topk_logprobs": ArraySpec("<f4", (c, 20), "completion", blocks(c)),
              "sample_support": ArraySpec("<i4", (c, 4), "completion", blocks(c))}
    return PayloadRef(uri=f"s3://bucket/prefix/run_1/{node_key(branch_id)}", branch_id=branch_id,
                      num_prompt_tokens=16, num_completion_tokens=c, arrays=arrays,
                      nbytes=layout_arrays(arrays)[1] + 4, checksum=checksum)


def test_wire_form_is_at_most_200_bytes_where_the_ref_takes_many_hundred():
    longest = _ref("a" * 128, num_tokens=2**20)
    typical = _ref(draw_branch_id("env_worker_3"))
    assert (len(longest.model_dump_json()), len(typical.model_dump_json())) == (90768, 825)
    assert len(PayloadSlice(longest, 2**20).slice_id.to_json()) == 193
    typical_id = PayloadSlice(typical, 4000).slice_id
    assert (len(typical_id.to_json()), len(pickle.dumps(typical_id))) == (107, 124)
    assert len(pickle.dumps(PayloadSlice(_ref("a" * 121), 4000).slice_id)) == 200
    assert json.loads(typical_id.to_json()) == {"branch_id": typical.branch_id, "num_tokens": 4000,
                                                "digest": ref_digest(typical)}


def test_slice_id_round_trips_through_json_and_pickle_and_resolves_to_the_slice():
    ref = _ref("b0")
    s = PayloadSlice(ref, 100)
    table = {"b0": ref, "b1": _ref("b1")}
    for wire in (SliceId.from_json(s.slice_id.to_json()), pickle.loads(pickle.dumps(s.slice_id))):
        assert wire == s.slice_id and wire.resolve(table) == s
    assert pickle.loads(pickle.dumps(s)) == s  # the in-memory slice pickles too (whole ref)


def test_digest_ignores_the_writers_uri_and_covers_everything_else():
    ref = _ref("b0")
    other_mount = ref.model_copy(update={"uri": f"file:///mnt/x/run_1/{node_key('b0')}"})
    assert ref_digest(other_mount) == ref_digest(ref)
    assert ref_digest(_ref("b0", checksum=8)) != ref_digest(ref)
    assert ref_digest(_ref("b0", num_tokens=4095)) != ref_digest(ref)
    assert len(ref_digest(ref)) == 16 and int(ref_digest(ref), 16) >= 0


def test_resolve_refuses_a_missing_ref_another_chunk_or_too_many_tokens():
    wire = PayloadSlice(_ref("b0"), 100).slice_id
    with pytest.raises(SliceError, match=r"^slice of branch 'b0': no ref of that branch in the table \(1 refs\)$"):
        wire.resolve({"b1": _ref("b1")})
    changed = _ref("b0", checksum=8)
    with pytest.raises(SliceError, match=rf"ref digest {ref_digest(changed)} in the table: expected {wire.digest}"):
        wire.resolve({"b0": changed})
    with pytest.raises(SliceError, match=r"keeps 4097 tokens of .*/b0: expected 1..4096"):
        wire._replace(num_tokens=4097).resolve({"b0": _ref("b0")})


@pytest.mark.parametrize("text", ['[1, 2]', '{"branch_id": "b0", "num_tokens": 3}', 'not json',
                                  '{"branch_id": "../x", "num_tokens": 3, "digest": "0123456789abcdef"}',
                                  '{"branch_id": "b0", "num_tokens": 0, "digest": "0123456789abcdef"}',
                                  '{"branch_id": "b0", "num_tokens": 3, "digest": "0123"}',
                                  '{"branch_id": "b0", "num_tokens": true, "digest": "0123456789abcdef"}'])
def test_malformed_wire_forms_are_slice_errors(text):
    with pytest.raises(SliceError, match=r"^slice .*(not a slice id|expected \{branch_id)"):
        SliceId.from_json(text)


def test_checked_refuses_a_slice_outside_its_ref():
    ref = _ref("b0", num_tokens=20)
    assert PayloadSlice(ref, np.int64(20)).checked("s") == PayloadSlice(ref, 20)
    for n in (0, 21, 2.0, True):
        with pytest.raises(SliceError, match=rf"^s: keeps {n!r} tokens of .*/b0: expected 1..20$"):
            PayloadSlice(ref, n).checked("s")
    with pytest.raises(SliceError, match=r"^s: ref is dict: expected a PayloadRef$"):
        PayloadSlice({"branch_id": "b0"}, 3).checked("s")


def test_a_kept_branch_slice_resolves_against_the_refs_keep_returned(local_config):
    store = open_store(local_config)
    kept = branch(make_keeper(store, local_config), np.random.default_rng(0), branch_id="k0")
    assert FIELDS.num_layers == 2
    wire = SliceId.from_json(PayloadSlice(kept.ref, 7).slice_id.to_json())
    assert wire.resolve({kept.ref.branch_id: kept.ref}) == PayloadSlice(kept.ref, 7)
