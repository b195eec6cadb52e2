"""From graded groups of samples to the trainer's batch."""

from __future__ import annotations

from miles_rollout import Sample
from miles_trainer import TrainBatch

__all__ = ["build_train_batch"]


def build_train_batch(
    groups: list[list[Sample]],
) -> tuple[TrainBatch | None, dict[str, float]]:
    """The trainer's batch of graded groups: rewards and group ids per sample, masks and
    per-token weight versions per token. The trainer turns rewards into advantages with its
    configured estimator (``trainer.advantage``).

    A group with any ungraded sample (aborted or failed) is dropped whole, because its
    baseline would be wrong. Returns ``(None, stats)`` when nothing is left to train on.

    Raises:
        ValueError: a sample whose lengths, masks or logprobs disagree (naming it).
    """
    kept = [g for g in groups if g and all(s.reward is not None for s in g)]
    stats = {"groups_dropped": float(len(groups) - len(kept))}
    if not kept:
        return None, stats
    stats["zero_std_groups_frac"] = sum(1 for g in kept if len({s.reward for s in g}) == 1) / len(
        kept
    )
    samples = [s for g in kept for s in g]
    for s in samples:
        s.check()
    return TrainBatch.from_samples(samples), stats
