"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest

from miles_trainer import grpo_advantages, reinforce_pp_advantages

# Group [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773502692,
# so A = +-0.5 / 0.5773502692 = +-0.8660254038 (= sqrt(3) / 2) with eps = 0.
# Group [0.5, 0.5, 0.5, 0.5]: zero variance -> all zeros.
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5]
S = 0.8660254038


def test_grpo_group_normalised_by_hand() -> None:
    got = grpo_advantages(REWARDS, 4, eps=0.0)
    assert got == pytest.approx([S, -S, S, -S, 0.0, 0.0, 0.0, 0.0], abs=1e-9)


def test_grpo_default_eps_is_added_to_std() -> None:
    got = grpo_advantages(REWARDS, 4)
    a = 0.5 / (0.5773502692 + 1e-6)  # = 0.8660239038
    assert got == pytest.approx([a, -a, a, -a, 0.0, 0.0, 0.0, 0.0], abs=1e-9)


def test_grpo_zero_variance_group_is_exactly_zero() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; a naive mean would leave a residue / tiny std.
    assert grpo_advantages([0.1, 0.1, 0.1], 3, eps=0.0) == [0.0, 0.0, 0.0]


def test_grpo_without_std_normalisation() -> None:
    got = grpo_advantages([1.0, 0.0, 3.0, 2.0, 2.0, 5.0], 3, normalize_std=False)
    # group means 4/3 and 3
    assert got == pytest.approx([-1 / 3, -4 / 3, 5 / 3, -1.0, -1.0, 2.0])


def test_grpo_groups_are_contiguous() -> None:
    got = grpo_advantages([0.0, 1.0, 10.0, 30.0], 2, eps=0.0)
    # each group of two: mean +-0.5 * gap, std = gap / sqrt(2): A = -+ 1 / sqrt(2)
    h = 1 / math.sqrt(2)
    assert got == pytest.approx([-h, h, -h, h])


def test_grpo_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        grpo_advantages([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        grpo_advantages([1.0], 0)
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        grpo_advantages([1.0, math.nan], 2)
    with pytest.raises(ValueError, match="empty"):
        grpo_advantages([], 1)


def test_reinforce_pp_batch_normalised_by_hand() -> None:
    # mean 2.5, unbiased std sqrt(5 / 3) = 1.2909944487; (r - 2.5) / std
    got = reinforce_pp_advantages([1.0, 2.0, 3.0, 4.0], eps=0.0)
    assert got == pytest.approx([-1.1618950039, -0.3872983346, 0.3872983346, 1.1618950039])


def test_reinforce_pp_with_group_baseline_by_hand() -> None:
    # group means 1.5 and 3.5 -> x = [-.5, .5, -.5, .5]; batch std sqrt(1 / 3) -> +-sqrt(3)/2
    got = reinforce_pp_advantages([1.0, 2.0, 3.0, 4.0], 2, eps=0.0)
    assert got == pytest.approx([-S, S, -S, S], abs=1e-9)


def test_reinforce_pp_constant_batch_is_zero() -> None:
    assert reinforce_pp_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
