"""Reward functions that break, for tests/test_first_hour_rewards.py (named by dotted path)."""

from __future__ import annotations

import threading

from miles_rollout import Sample


def flaky(sample: Sample) -> float:
    """Raises on every second sample of a group (a verifier that fails now and then)."""
    if sample.index % 2 == 1:
        raise ConnectionError("verifier unreachable")
    return float(len(sample.response) % 2 == 0)


def returns_text(sample: Sample) -> str:
    """Breaks the RewardFn contract: a string, not a number."""
    return "1.0"


def hang(sample: Sample) -> float:
    """Never returns (a verifier stuck on I/O); miles runs it in a daemon thread it abandons."""
    threading.Event().wait()
    return 1.0
