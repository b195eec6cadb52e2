"""From graded groups of samples to the trainer's batch."""

from __future__ import annotations

from miles_rollout import Sample
from miles_trainer import TrainBatch, grpo_advantages

__all__ = ["build_train_batch"]


def build_train_batch(
    groups: list[list[Sample]],
) -> tuple[TrainBatch | None, dict[str, float]]:
    """Group-normalised (GRPO) advantages broadcast over each sample's response tokens.

    A group with any ungraded sample (aborted or failed) is dropped whole, because its
    baseline would be wrong. Returns ``(None, stats)`` when nothing is left to train on.
    """
    kept = [g for g in groups if g and all(s.reward is not None for s in g)]
    stats = {"groups_dropped": float(len(groups) - len(kept))}
    if not kept:
        return None, stats
    size = len(kept[0])
    assert all(len(g) == size for g in kept), "all groups must have the same size"
    samples = [s for g in kept for s in g]
    rewards = [float(s.reward) for s in samples]  # type: ignore[arg-type]
    adv = grpo_advantages(rewards, size)
    stats["zero_std_groups_frac"] = sum(1 for g in kept if len({s.reward for s in g}) == 1) / len(
        kept
    )
    for s in samples:
        s.check()
    batch = TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[list(s.loss_mask) for s in samples],
        rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
        advantages=[[a] * s.response_length for a, s in zip(adv, samples)],
    )
    return batch, stats
