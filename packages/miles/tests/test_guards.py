"""The step guard: runs that cannot learn stop (or warn) with the reason."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from miles.guards import RunStoppedError, StepGuard
from miles.rewards.timeout import with_timeout
from miles_rollout import Sample
from miles_rollout.reward import grade


def _guard(action: str = "warn", steps: int = 3, drop: float = 0.5) -> StepGuard:
    return StepGuard(max_drop_frac=drop, no_signal_steps=steps, no_signal_action=action)


def test_nothing_to_train_on_stops_with_the_reason() -> None:
    with pytest.raises(
        RunStoppedError, match="nothing to train on: all 4 groups were dropped"
    ) as e:
        _guard().check(3, 4, None, {"groups_dropped": 4.0})
    assert "rollout.engine_url" in str(e.value)  # no reward failed: the engines come first


async def _hang(sample: Sample) -> float:
    await asyncio.Event().wait()  # never set: a reward that never returns
    return 1.0


def _raise(sample: Sample) -> float:
    raise ConnectionError("verifier unreachable")


def _graded(fns: list[Callable[[Sample], Any] | None], n: int = 2) -> list[list[Sample]]:
    """One group of ``n`` samples per function, graded by the real ``grade`` under drop."""
    groups = [
        [Sample(group_index=gi, index=i, prompt="1+1=", response="2") for i in range(n)]
        for gi in range(len(fns))
    ]

    async def run() -> None:
        for fn, group in zip(fns, groups, strict=True):
            for s in group:
                if fn is None:
                    s.reward = 1.0
                else:
                    await grade(s, with_timeout(fn, 0.01), on_error="drop")

    asyncio.run(run())
    return groups


def test_rewards_that_time_out_are_named_before_the_engines() -> None:
    groups = _graded([_hang, _hang])
    guard = StepGuard(
        max_drop_frac=0.5, no_signal_steps=0, no_signal_action="warn", reward_timeout_s=0.01
    )
    with pytest.raises(RunStoppedError) as e:
        guard.check(1, 2, None, {"groups_dropped": 2.0}, groups=groups)
    msg = str(e.value)
    assert msg.startswith(
        "step 1: nothing to train on: all 2 groups were dropped: "
        "the reward function test_guards:_hang timed out (task.reward_timeout_s=0.01 s) on 4 of "
        "the step's 4 samples, so their 2 group(s) were dropped (task.reward_errors: drop). First "
        "failure: reward function test_guards:_hang raised RewardTimeoutError("
    ), msg
    for fix in ("raise task.reward_timeout_s", "task.reward_errors: zero", "or fail"):
        assert fix in msg
    assert "engine" not in msg


def test_reward_errors_and_engine_drops_are_both_named_reward_first() -> None:
    groups = _graded([_raise, None, None, None])
    groups[1][0].reward = None  # an aborted generation: no reward, no reward_error
    guard = _guard(drop=0.25)
    with pytest.raises(RunStoppedError) as e:
        guard.check(2, 4, object(), {"groups_dropped": 2.0}, groups=groups)
    msg = str(e.value)
    assert msg.startswith(
        "step 2: 2 of 4 groups were dropped, above rollout.max_drop_frac=0.25: the reward "
        "function test_guards:_raise failed on 2 of the step's 8 samples, so their 1 group(s) "
        "were dropped (task.reward_errors: drop); 1 other group(s) had aborted or failed "
        "generations (check the engines: rollout.engine_url). First failure: "
        "reward function test_guards:_raise raised ConnectionError('verifier unreachable')"
    ), msg
    assert "Fix: fix the function, or set task.reward_errors: zero" in msg
    assert "reward_timeout_s" not in msg


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
