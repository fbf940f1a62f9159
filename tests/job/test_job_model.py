"""The MoE policy: shapes, varlen isolation, routing replay, seeding, input errors."""

from __future__ import annotations

import pydantic
import pytest
import torch

from refpipe.job.workload.model import BOS_ID, VOCAB_SIZE, ModelConfig, MoELM, token_logprobs
from refpipe.storage.errors import FieldError
from tests.job.routing_helpers import ROUTER_MARGIN, router_margin


def _packed(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (sum(lengths),), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids, position_ids, cu_seqlens


def test_shapes_and_routing_rules(model):
    logits, routing = model(*_packed([5, 9, 1]))
    assert logits.shape == (15, VOCAB_SIZE) and logits.dtype == torch.float32
    assert routing.shape == (15, 2, 2) and routing.dtype == torch.uint8
    assert int(routing.max()) < 8
    assert bool((routing[..., 0] != routing[..., 1]).all())  # top-2 picks two distinct experts
    assert sum(p.numel() for p in model.parameters()) == 268288


def test_attention_does_not_cross_sequences(model):
    ids, pos, cu = _packed([6, 7])
    packed_logits, packed_routing = model(ids, pos, cu)
    alone_logits, alone_routing = model(ids[6:], pos[6:], torch.tensor([0, 7], dtype=torch.int32))
    torch.testing.assert_close(packed_logits[6:], alone_logits, rtol=0, atol=1e-5)
    assert router_margin(model, ids, pos, cu) > ROUTER_MARGIN  # so the ids below are equal on every CPU
    assert torch.equal(packed_routing[6:], alone_routing)
    changed = ids.clone()
    changed[:6] = (changed[:6] + 1) % 256  # rewrite the first sequence only
    logits, _ = model(changed, pos, cu)
    # Not bitwise: rewriting the first sequence changes how many tokens each expert's matmul
    # gets, so the kernels (AVX2 vs AVX-512 blockings) round differently; the property holds to ~1e-6.
    torch.testing.assert_close(logits[6:], packed_logits[6:], rtol=0, atol=1e-5)
    assert not torch.allclose(logits[:6], packed_logits[:6])


def test_sequences_of_every_length_bucket_match_their_forward_alone(model):
    lengths = [1, 6, 0, 100, 7, 33]  # buckets 0, 3, empty, 7, 3, 6; the 100-token one stands for padding
    ids, _, cu = _packed(lengths, seed=3)
    pos = torch.cat([torch.arange(n).clamp(max=63) for n in lengths])
    assert router_margin(model, ids, pos, cu) > ROUTER_MARGIN  # so the ids below are equal on every CPU
    with torch.no_grad():
        packed_logits, packed_routing = model(ids, pos, cu)
        for start, end in zip(cu.tolist(), cu.tolist()[1:]):
            if end > start:
                logits, routing = model(ids[start:end], pos[start:end],
                                        torch.tensor([0, end - start], dtype=torch.int32))
                torch.testing.assert_close(packed_logits[start:end], logits, rtol=0, atol=1e-5)
                assert torch.equal(packed_routing[start:end], routing)


def test_replay_reproduces_the_forward_bit_for_bit(model):
    batch = _packed([8, 11, 4], seed=1)
    logits, routing = model(*batch)
    replayed_logits, replayed_routing = model(*batch, routed_experts=routing)
    assert torch.equal(replayed_logits, logits) and torch.equal(replayed_routing, routing)
    as_int64 = routing.to(torch.int64)
    as_int64[3:] = -1  # negative rows route freely
    partial_logits, partial_routing = model(*batch, routed_experts=as_int64)
    assert torch.equal(partial_logits, logits) and torch.equal(partial_routing, routing)


def test_replay_uses_the_given_experts(model):
    batch = _packed([8, 11], seed=2)
    logits, routing = model(*batch)
    other = ((routing.to(torch.int64) + 3) % 8).to(torch.uint8)
    other_logits, used = model(*batch, routed_experts=other)
    assert torch.equal(used, other)
    assert float((other_logits - logits).detach().abs().max()) > 1e-2


def test_parameters_are_seeded(model_cfg):
    a, b = MoELM(model_cfg).state_dict(), MoELM(model_cfg).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = MoELM(model_cfg.model_copy(update={"seed": 1})).state_dict()
    assert not torch.equal(a["blocks.0.moe.w_in"], c["blocks.0.moe.w_in"])


def test_token_logprobs_is_temperature_scaled_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    got = token_logprobs(logits, torch.tensor([2, 1]), temperature=0.5)
    expected = torch.tensor([6.0 - torch.logsumexp(torch.tensor([2.0, 4.0, 6.0]), 0), -torch.log(torch.tensor(3.0))])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: (b[0], b[1], torch.tensor([0, 5], dtype=torch.int32), None), r"cu_seqlens \[0, 5\]"),
        (lambda b: (b[0], b[1], b[2], torch.full((6, 2, 2), 8, dtype=torch.uint8)), "id 8: expected < num_experts=8"),
        (lambda b: (b[0], b[1], b[2], torch.zeros(6, 2, 1, dtype=torch.uint8)),
         r"shape \[6, 2, 1\]: expected \[6, 2, 2\]"),
        (lambda b: (b[0], b[1] + 60, b[2], None), "position_ids max 65: expected < max_positions=64"),
        (lambda b: (b[0] + BOS_ID, b[1], b[2], None), "input_ids outside"),
    ],
)
def test_bad_inputs_raise_field_error(model, change, message):
    with pytest.raises(FieldError, match=message):
        model(*change(_packed([6])))


def test_config_is_validated():
    with pytest.raises(pydantic.ValidationError, match="num_heads=3 must divide d_model=64"):
        ModelConfig(num_heads=3)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ModelConfig(hidden=3)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        ModelConfig().d_model = 8
