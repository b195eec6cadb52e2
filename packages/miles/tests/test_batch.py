"""From graded samples to a TrainBatch: GRPO advantages and dropped groups."""

from __future__ import annotations

from miles.rollout import build_train_batch
from miles_rollout import Sample, SampleStatus


def _sample(g: int, i: int, reward: float | None, n_resp: int = 2) -> Sample:
    return Sample(
        group_index=g,
        index=i,
        prompt="p",
        tokens=[1, 2, 3, *range(10, 10 + n_resp)],
        response_length=n_resp,
        loss_mask=[1] * n_resp,
        rollout_logprobs=[-0.5] * n_resp,
        reward=reward,
        status=SampleStatus.COMPLETED if reward is not None else SampleStatus.ABORTED,
    )


def test_rewards_and_groups_reach_the_trainer() -> None:
    groups = [
        [_sample(0, 0, 1.0, 3), _sample(0, 1, 0.0, 1)],
        [_sample(1, 0, 1.0), _sample(1, 1, 1.0)],
    ]
    batch, stats = build_train_batch(groups)
    assert batch is not None
    assert batch.rewards == [1.0, 0.0, 1.0, 1.0]
    assert batch.group_ids == [0, 0, 1, 1]
    assert batch.advantages is None  # the trainer's estimator computes them
    assert batch.response_lengths == [3, 1, 2, 2]
    assert stats["zero_std_groups_frac"] == 0.5
    assert stats["groups_dropped"] == 0.0


def test_group_with_ungraded_sample_is_dropped_whole() -> None:
    groups = [[_sample(0, 0, 1.0), _sample(0, 1, None)], [_sample(1, 0, 1.0), _sample(1, 1, 0.0)]]
    batch, stats = build_train_batch(groups)
    assert batch is not None
    assert len(batch.tokens) == 2
    assert stats["groups_dropped"] == 1.0
    none_left, stats = build_train_batch([[_sample(0, 0, None), _sample(0, 1, 1.0)]])
    assert none_left is None
    assert stats["groups_dropped"] == 1.0
