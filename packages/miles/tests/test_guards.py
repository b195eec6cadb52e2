"""The step guard: runs that cannot learn stop (or warn) with the reason."""

from __future__ import annotations

import logging

import pytest

from miles.guards import RunStoppedError, StepGuard


def _guard(action: str = "warn", steps: int = 3, drop: float = 0.5) -> StepGuard:
    return StepGuard(max_drop_frac=drop, no_signal_steps=steps, no_signal_action=action)


def test_nothing_to_train_on_stops_with_the_reason() -> None:
    with pytest.raises(RunStoppedError, match="nothing to train on: all 4 groups were dropped"):
        _guard().check(3, 4, None, {"groups_dropped": 4.0})


def test_too_many_dropped_groups_stop() -> None:
    guard = _guard(drop=0.25)
    guard.check(1, 4, object(), {"groups_dropped": 1.0, "zero_std_groups_frac": 0.0})
    with pytest.raises(RunStoppedError, match=r"2 of 4 groups were dropped.*max_drop_frac=0.25"):
        guard.check(2, 4, object(), {"groups_dropped": 2.0, "zero_std_groups_frac": 0.0})


def test_no_signal_warns_once_per_streak_and_resets(caplog: pytest.LogCaptureFixture) -> None:
    guard = _guard("warn", steps=2)
    stats = [{"zero_std_groups_frac": f} for f in (1.0, 1.0, 1.0, 0.5, 1.0, 1.0)]
    with caplog.at_level(logging.WARNING, logger="miles"):
        for step, st in enumerate(stats, 1):
            guard.check(step, 4, object(), st, reward_mean=0.0)
    assert [s["no_signal_streak"] for s in stats] == [1, 2, 3, 0, 1, 2]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # steps 2 and 6: once per streak
    assert "too hard (reward always 0" in warnings[0]


def test_no_signal_stop() -> None:
    guard = _guard("stop", steps=2)
    guard.check(1, 4, object(), {"zero_std_groups_frac": 0.95})
    with pytest.raises(RunStoppedError, match="for 2 steps in a row"):
        guard.check(2, 4, object(), {"zero_std_groups_frac": 1.0})
