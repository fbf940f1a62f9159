"""The reverse task: prompt generation, exact rewards, the warm start."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from refpipe.job.workload.model import BOS_ID, EOS_ID, MoELM
from refpipe.job.workload.rollout import SamplingConfig, sample_branches
from refpipe.job.workload.task import TaskConfig, make_problems, reward, warm_start


def _ids(text: str, eos: bool = False) -> np.ndarray:
    return np.array([*text.encode(), *([EOS_ID] if eos else [])], dtype=np.int32)


def test_problems_are_deterministic_and_well_formed():
    cfg = TaskConfig(seed=5)
    problems = make_problems(cfg, 40, index=7)
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(problems, make_problems(cfg, 40, index=7)))
    assert any(not np.array_equal(a.prompt_ids, b.prompt_ids)
               for a, b in zip(problems, make_problems(cfg, 40, index=8)))
    for p in problems:
        assert p.prompt_ids.dtype == p.target_ids.dtype == np.int32 and p.prompt_ids[0] == BOS_ID
        text = bytes(p.prompt_ids[1:].astype(np.uint8)).decode()
        word = text[len("rev:") : -1]
        assert text == f"rev:{word}=" and 3 <= len(word) <= 7 and set(word) <= set("abcdefgh")
        assert np.array_equal(p.target_ids, _ids(word[::-1]))
    assert {len(p.target_ids) for p in problems} == {3, 4, 5, 6, 7}


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (_ids("abc", eos=True), 1.0),
        (_ids("abx", eos=True), 2 / 3),
        (_ids("ab", eos=True), 2 / 3),
        (_ids("abcd", eos=True), 3 / 4),
        (_ids("xabc", eos=True), 0.0),
        (_ids("", eos=True), 0.0),
        (_ids("abc"), 1.0),  # cut at max length without EOS: scored whole
        (_ids("abca"), 3 / 4),
        (np.array([*_ids("abc", eos=True), ord("z"), EOS_ID], dtype=np.int32), 1.0),  # after the first EOS: ignored
        (np.array([ord("a"), BOS_ID, ord("c"), EOS_ID], dtype=np.int32), 2 / 3),
    ],
)
def test_reward_exact_values(completion, expected):
    assert reward(completion, _ids("abc")) == expected


def test_reward_of_two_empty_sequences_is_one():
    assert reward(_ids("", eos=True), _ids("")) == 1.0


def test_config_is_validated():
    with pytest.raises(pydantic.ValidationError, match="max_letters=2 < min_letters=3"):
        TaskConfig(max_letters=2)
    with pytest.raises(pydantic.ValidationError, match="alphabet"):
        TaskConfig(alphabet="")


def test_warm_start_is_deterministic(model_cfg):
    losses = [warm_start(MoELM(model_cfg), TaskConfig(), steps=3, batch_size=8) for _ in range(2)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_warm_start_gives_the_format_and_leaves_room(model):
    problems = make_problems(TaskConfig(), 64, index=0)
    sampling = SamplingConfig()

    def mean_reward():
        branches = sample_branches(model, [p.prompt_ids for p in problems], sampling, seed=0)
        return float(np.mean([reward(b.completion_ids, p.target_ids) for b, p in zip(branches, problems)]))

    before = mean_reward()
    losses = warm_start(model, TaskConfig(), steps=60)
    after = mean_reward()
    assert losses[-1] < losses[0] / 2
    assert before < 0.05 and 0.15 < after < 0.6
