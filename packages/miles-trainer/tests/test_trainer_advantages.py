"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest

from miles_trainer import (
    AdvantageConfig,
    OverlongConfig,
    TrainBatch,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from miles_trainer.advantages import (
    batch_advantages,
    gae_advantages,
    overlong_penalty,
    shape_and_filter,
)

# Group [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773502692,
# so A = +-0.5 / 0.5773502692 = +-0.8660254038 (= sqrt(3) / 2) with eps = 0.
# Group [0.5, 0.5, 0.5, 0.5]: zero variance -> all zeros.
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5]
S = 0.8660254038
H = 1 / math.sqrt(2)


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


# ---------------------------------------------------------------- the hub's estimators


def test_group_ids_need_not_be_contiguous() -> None:
    # groups {0: [1, 0, 1, 0] at even positions}, {1: [0.5] * 4 at odd positions}
    got = grpo_advantages([1.0, 0.5, 0.0, 0.5, 1.0, 0.5, 0.0, 0.5], group_ids=[0, 1] * 4, eps=0.0)
    assert got == pytest.approx([S, 0.0, -S, 0.0, S, 0.0, -S, 0.0], abs=1e-9)
    with pytest.raises(ValueError, match="exactly one of group_size and group_ids"):
        grpo_advantages([1.0, 2.0], 2, group_ids=[0, 0])


def test_rloo_leave_one_out_by_hand() -> None:
    # group [1, 0, 0, 1]: A_i = r_i - (2 - r_i) / 3 = +-2/3; constant group -> 0
    got = rloo_advantages([1.0, 0.0, 0.0, 1.0, 0.3, 0.3], group_ids=[0, 0, 0, 0, 1, 1])
    assert got == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0])
    with pytest.raises(ValueError, match="sample 2 is alone in its group"):
        rloo_advantages([1.0, 0.0, 0.5], group_ids=[0, 0, 1])


def test_gae_over_a_sample_with_a_hole_by_hand() -> None:
    """mask [1, 0, 1, 1] (a tool token at 1), V = [.5, 9, .2, .4], reward 1, gamma .9, lam .8.

    The trajectory is positions 0, 2, 3 (the tool token is stepped over):
        t=3: delta = 1 - .4 = .6                        A = .6,  R = 1.0
        t=2: delta = .9 * .4 - .2 = .16                 A = .16 + .72 * .6 = .592,  R = .792
        t=0: delta = .9 * .2 - .5 = -.32                A = -.32 + .72 * .592 = .10624
    """
    adv, ret = gae_advantages([1.0], [[0.5, 9.0, 0.2, 0.4]], [[1, 0, 1, 1]], gamma=0.9, lam=0.8)
    assert adv[0] == pytest.approx([0.10624, 0.0, 0.592, 0.6])
    assert ret[0] == pytest.approx([0.60624, 0.0, 0.792, 1.0])
    # gamma = lam = 1: the advantage is reward - V_t, the return the reward
    adv, ret = gae_advantages([2.0], [[0.5, 1.5]], [[1, 1]])
    assert adv[0] == pytest.approx([1.5, 0.5])
    assert ret[0] == pytest.approx([2.0, 2.0])


def test_overlong_penalty_by_hand() -> None:
    # budget 10, soft zone 4: 0 up to 6, then linear to -1 at 10, -1 beyond
    got = [overlong_penalty(n, 10, 4) for n in (3, 6, 8, 10, 11)]
    assert got == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert OverlongConfig(max_length=10, buffer_length=4, penalty_factor=0.5).build()(8) == -0.25


def _batch(rewards: list[float], group_ids: list[int], lengths: list[int]) -> TrainBatch:
    return TrainBatch(
        tokens=[[1] * (n + 1) for n in lengths],
        response_lengths=lengths,
        loss_masks=[[1] * n for n in lengths],
        rollout_logprobs=[[-1.0] * n for n in lengths],
        rewards=rewards,
        group_ids=group_ids,
    )


def test_dynamic_sampling_filter_and_overlong_shaping() -> None:
    """DAPO: groups with equal rewards are dropped, after the overlong penalty shapes them."""
    batch = _batch([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], [0, 0, 1, 1, 2, 2], [2, 9, 2, 2, 2, 2])
    cfg = AdvantageConfig(
        group_filter="nonzero_std", overlong=OverlongConfig(max_length=10, buffer_length=4)
    )
    kept, metrics = shape_and_filter(batch, cfg)
    # sample 1 (9 tokens) gets -0.75, so group 0 now varies; group 2 is constant: dropped
    assert kept is not None
    assert kept.group_ids == [0, 0, 1, 1]
    assert kept.rewards == pytest.approx([1.0, 0.25, 0.0, 1.0])
    assert metrics == pytest.approx(
        {
            "reward_mean": 5 / 6,
            "overlong_penalty_mean": -0.75 / 6,
            "groups": 3.0,
            "zero_std_groups_frac": 1 / 3,
            "groups_filtered": 1.0,
        }
    )
    everything, metrics = shape_and_filter(_batch([1.0, 1.0], [0, 0], [1, 1]), cfg)
    assert everything is None
    assert metrics["groups_filtered"] == 1.0


def test_user_group_filter_and_estimators_by_dotted_path() -> None:
    batch = _batch([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], [2, 3, 1, 2])
    kept, _ = shape_and_filter(
        batch, AdvantageConfig(group_filter="_trainer_hooks:keep_even_groups")
    )
    assert kept is not None
    assert kept.group_ids == [0, 0]
    bad = AdvantageConfig(group_filter="_trainer_hooks:not_a_bool")
    with pytest.raises(TypeError, match="must return True"):
        shape_and_filter(batch, bad)

    cfg = AdvantageConfig(estimator="_trainer_hooks:constant_advantage", params={"value": 0.5})
    adv, returns = batch_advantages(batch, cfg)
    assert adv == [[0.5] * 2, [0.5] * 3, [0.5], [0.5] * 2]
    assert returns is None
    cfg = AdvantageConfig(estimator="_trainer_hooks:position_advantage")
    adv, _ = batch_advantages(batch, cfg)
    assert adv == [[0.0, 1.0], [0.0, 1.0, 2.0], [0.0], [0.0, 1.0]]


@pytest.mark.parametrize(
    ("estimator", "want"),
    [
        # groups [1, 0] and [3, 2]: mean +-0.5, unbiased std 1/sqrt(2)
        ("grpo", [H, -H, H, -H]),
        ("dr_grpo", [0.5, -0.5, 0.5, -0.5]),
        ("rloo", [1.0, -1.0, 1.0, -1.0]),
    ],
)
def test_batch_advantages_per_estimator(estimator: str, want: list[float]) -> None:
    batch = _batch([1.0, 0.0, 3.0, 2.0], [0, 0, 1, 1], [1, 2, 1, 1])
    adv, _ = batch_advantages(batch, AdvantageConfig(estimator=estimator, eps=0.0))
    assert [row[0] for row in adv] == pytest.approx(want)
    assert adv[1] == [adv[1][0]] * 2  # repeated over the response


def test_whitening_over_loss_tokens_by_hand() -> None:
    """per-token [1, 1 | 3] (mask all 1): mean 5/3, unbiased std sqrt(4/3)."""
    batch = TrainBatch(
        tokens=[[1, 2, 3], [1, 2]],
        response_lengths=[2, 1],
        loss_masks=[[1, 1], [1]],
        rollout_logprobs=[[-1.0, -1.0], [-1.0]],
        rewards=[1.0, 3.0],
    )
    adv, _ = batch_advantages(batch, AdvantageConfig(estimator="reinforce_pp", eps=0.0))
    z = 1 / math.sqrt(2)  # reinforce_pp: (r - 2) / std([1, 3]) = -+1 / sqrt(2)
    assert adv == [pytest.approx([-z, -z]), pytest.approx([z])]
    whitened, _ = batch_advantages(
        batch, AdvantageConfig(estimator="reinforce_pp", eps=0.0, whiten=True)
    )
    s = math.sqrt(4 / 3)
    assert whitened == [pytest.approx([-2 / 3 / s] * 2), pytest.approx([4 / 3 / s])]


def test_grouped_estimators_need_group_ids() -> None:
    batch = TrainBatch(
        tokens=[[1, 2], [1, 2]],
        response_lengths=[1, 1],
        loss_masks=[[1], [1]],
        rollout_logprobs=[[-1.0], [-1.0]],
        rewards=[1.0, 0.0],
    )
    with pytest.raises(ValueError, match="needs group_ids"):
        batch_advantages(batch, AdvantageConfig(estimator="grpo"))
    adv, _ = batch_advantages(batch, AdvantageConfig(estimator="reinforce_pp", eps=0.0))
    assert adv == [[pytest.approx(1 / math.sqrt(2))], [pytest.approx(-1 / math.sqrt(2))]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"estimator": "ppo"}, "estimator must be one of"),
        ({"gamma": 1.5}, "gamma must be in"),
        ({"lam": -0.1}, "lam must be in"),
        ({"eps": -1.0}, "eps must be finite"),
        ({"group_filter": "dapo"}, "group_filter must be None"),
    ],
)
def test_advantage_config_rejects(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdvantageConfig(**kwargs)  # type: ignore[arg-type]


def test_overlong_config_rejects() -> None:
    with pytest.raises(ValueError, match="buffer_length must be in"):
        OverlongConfig(max_length=4, buffer_length=5)
