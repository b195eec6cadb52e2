"""Custom reward functions used by the end-to-end tests through `task.reward_fn`."""

from __future__ import annotations

from miles_rollout import Sample


def response_parity(sample: Sample) -> float:
    """1.0 for an even number of response characters: varies even for an untrained policy,
    so every group has a non-zero advantage and the weights must move."""
    return float(len(sample.response) % 2 == 0)
