"""Group-relative advantages, pruning, reward filter and staleness: exact values."""

from __future__ import annotations

import numpy as np

from refpipe.pipeline.advantages import group_advantages, reward_in_range, stale, zero_advantage


def test_mean_baseline_with_and_without_std_normalisation():
    r, n = np.array([1.0, 0.0, 0.0, 1.0]), np.array([5, 1, 2, 7])
    plain = group_advantages(r, n, std_normalize=False, length_weighted_baseline=False)
    assert plain.dtype == np.float32 and plain.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(r, n, std_normalize=True, length_weighted_baseline=False).tolist() == [1, -1, -1, 1]


def test_length_weighted_baseline_sums_to_zero_over_tokens():
    r, n = np.array([1.0, 0.0]), np.array([3, 1])
    adv = group_advantages(r, n, std_normalize=False, length_weighted_baseline=True)
    assert adv.tolist() == [0.25, -0.75] and float((adv * n).sum()) == 0.0
    assert group_advantages(r, n, std_normalize=True, length_weighted_baseline=True).tolist() == [0.5, -1.5]


def test_equal_rewards_give_exact_zeros():
    for r in ([0.1] * 3, [7.0], []):
        adv = group_advantages(np.array(r), np.array([3, 1, 2][: len(r)]), std_normalize=True,
                               length_weighted_baseline=True)
        assert adv.dtype == np.float32 and adv.tolist() == [0.0] * len(r)


def test_zero_advantage_reward_range_and_staleness():
    assert zero_advantage(np.array([0, 1e-7, -1e-6, 1e-5, -2], np.float32)).tolist() == [True, True, True, False, False]
    assert reward_in_range(np.array([0.0, 1.0]), None)
    assert reward_in_range(np.array([0.0, 1.0]), (0.5, 1.0)) and reward_in_range(np.array([0.0, 1.0]), (0.0, 0.5))
    assert not reward_in_range(np.array([1.0, 1.0]), (0.0, 0.9))
    assert stale([0, 1, 2, 3], step=3, max_async_level=1).tolist() == [True, True, False, False]
    assert stale([0, 1, 2, 3], step=3, max_async_level=0).tolist() == [True, True, True, False]
