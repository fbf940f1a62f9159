"""Samples built from branches: exact streams, truncation by slice, typed construction errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refpipe.pipeline.samples import (
    BranchResult,
    Episode,
    PayloadSlice,
    Sample,
    build_sample,
    check_episode,
    kept_completion_tokens,
)
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.errors import EpisodeError, PackingError
from refpipe.storage.layout import node_key
from refpipe.storage.uri import RunPrefix

REF = PayloadRef(uri=f"file:///runs/run_1/{node_key('b0')}", branch_id="b0", num_prompt_tokens=2,
                 num_completion_tokens=3, arrays={"routed_experts": ArraySpec("|u1", (5, 2, 2), "tokens", (0,))},
                 nbytes=68, checksum=0)
BRANCH = BranchResult(prompt_ids=np.array([7, 8], np.int32), completion_ids=np.array([1, 2, 3], np.int32),
                      inference_logprobs=np.array([-0.5, -0.25, -2.0], np.float32), temperature=0.5,
                      policy_version=3, ref=REF)
EPISODE = Episode("e0", "g0", "reverse", [1.0, 0.0], [BRANCH, BRANCH])


def test_sample_streams_of_a_whole_branch():
    s = build_sample(EPISODE, BRANCH, reward=1.0, advantage=1.5, seq_len=8)
    assert s.input_ids.tolist() == [7, 8, 1, 2, 3]
    assert s.loss_mask.tolist() == [False, False, True, True, True]
    assert s.advantages.tolist() == [0, 0, 1.5, 1.5, 1.5]
    assert s.inference_logprobs.tolist() == [0, 0, -0.5, -0.25, -2.0]
    assert s.position_ids.tolist() == [0, 1, 2, 3, 4] and s.temperatures.tolist() == [0.5] * 5
    assert {k: v.dtype.str for k, v in s.streams().items()} == {
        "input_ids": "<i4", "loss_mask": "|b1", "advantages": "<f4", "inference_logprobs": "<f4",
        "position_ids": "<i4", "temperatures": "<f4"}
    assert s.payload == PayloadSlice(REF, 5) and s.has_routing and s.num_tokens == 5
    assert (s.env_name, s.policy_version, s.reward, s.episode_id) == ("reverse", 3, 1.0, "e0")


def test_truncation_keeps_the_first_tokens_and_shrinks_the_slice():
    s = build_sample(EPISODE, BRANCH, reward=0.0, advantage=-1.0, seq_len=3)
    assert s.input_ids.tolist() == [7, 8, 1] and s.loss_mask.tolist() == [False, False, True]
    assert s.advantages.tolist() == [0, 0, -1] and s.inference_logprobs.tolist() == [0, 0, -0.5]
    assert s.payload == PayloadSlice(REF, 3) and s.payload.ref.num_tokens == 5
    assert [kept_completion_tokens(BRANCH, n) for n in (1, 2, 3, 5, 9)] == [0, 0, 1, 3, 3]
    with pytest.raises(PackingError,
                       match="episode e0: prompt of 2 tokens leaves no completion token within seq_len=2"):
        build_sample(EPISODE, BRANCH, reward=0.0, advantage=1.0, seq_len=2)


def test_episode_rewards_and_refs():
    assert EPISODE.branch_rewards().tolist() == [1.0, 0.0]
    assert Episode("e1", "g0", "x", 0.5, [BRANCH, BRANCH]).branch_rewards().tolist() == [0.5, 0.5]
    assert EPISODE.refs() == [REF, REF] and BRANCH.num_tokens == 5


def test_sample_construction_checks_streams_and_slice():
    good = build_sample(EPISODE, BRANCH, reward=1.0, advantage=1.0, seq_len=8)
    fields = {**good.__dict__}
    with pytest.raises(PackingError, match=r"episode e0: stream advantages is <f8 \[5\]: expected <f4 \[5\]"):
        Sample(**{**fields, "advantages": good.advantages.astype(np.float64)})
    with pytest.raises(PackingError, match=r"stream loss_mask is \|b1 \[4\]: expected \|b1 \[5\]"):
        Sample(**{**fields, "loss_mask": good.loss_mask[:4]})
    with pytest.raises(PackingError, match=rf"keeps 4 tokens of {REF.uri}: expected 5"):
        Sample(**{**fields, "payload": PayloadSlice(REF, 4)})


def test_completion_mask_keeps_unsampled_turns_out_of_the_loss():
    """Multi-turn: tool/user tokens inside the completion get loss_mask False and advantage 0."""
    mask = np.array([True, True, False, False, True])
    branch = BranchResult(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=np.arange(5, dtype=np.int32),
                          inference_logprobs=np.full(5, -0.5, np.float32), temperature=1.0, policy_version=0,
                          completion_mask=mask)
    episode = Episode("e0", "g0", "env", 1.0, [branch])
    sample = build_sample(episode, branch, reward=1.0, advantage=2.0, seq_len=7)
    assert sample.loss_mask.tolist() == [False, False, False, True, True, False, False]
    assert sample.advantages.tolist() == [0, 0, 0, 2.0, 2.0, 0, 0]


@pytest.mark.parametrize("change,vocab_size,message", [
    ({"inference_logprobs": np.array([-0.5, np.nan, -2.0], np.float32)}, None,
     "inference_logprobs[1] = nan: expected a finite logprob <= 0"),
    ({"inference_logprobs": np.array([-0.5, -0.25, 3.0], np.float32)}, None,
     "inference_logprobs[2] = 3.0: expected a finite logprob <= 0"),
    ({"inference_logprobs": np.array([-np.inf, -0.25, -1.0], np.float32)}, None,
     "inference_logprobs[0] = -inf: expected a finite logprob <= 0"),
    ({"completion_ids": np.array([1, -1, 3], np.int32)}, None, "completion_ids[1] = -1: expected a token id >= 0"),
    ({"prompt_ids": np.array([7, 80], np.int32)}, 64, "prompt_ids[1] = 80: expected a token id >= 0 and < "
                                                      "vocab_size=64"),
])
def test_a_bad_value_is_refused_naming_episode_branch_array_and_index(change, vocab_size, message):
    bad = dataclasses.replace(BRANCH, **change)
    with pytest.raises(EpisodeError) as info:
        check_episode(Episode("e9", "g0", "reverse", [1.0, 0.0], [BRANCH, bad]), RunPrefix.from_root("/runs", "run_1"),
                      vocab_size=vocab_size)
    assert str(info.value) == f"episode 'e9' (group 'g0', env 'reverse') branch 1: {message}"
