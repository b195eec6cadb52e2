"""Reward function failures: named, counted, and handled by the policy (fail | zero | drop)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from miles_rollout import Sample, SampleStatus, rollout_metrics
from miles_rollout.reward import RewardError, callable_name, grade


def _sample(response: str = "19", **metadata: Any) -> Sample:
    return Sample(
        group_index=3,
        index=1,
        prompt=[{"role": "user", "content": "12+7="}],
        label=19,
        response=response,
        status=SampleStatus.COMPLETED,
        metadata=dict(metadata),
    )


def exact(sample: Sample) -> float:
    return float(sample.response.strip() == str(sample.label))


def broken(sample: Sample) -> float:
    return {"a": 1}[sample.response]  # KeyError


async def async_broken(sample: Sample) -> float:
    raise RuntimeError("verifier unreachable")


def returns_text(sample: Sample) -> Any:
    return "1.0"


def returns_none(sample: Sample) -> Any:
    return None


def returns_nan(sample: Sample) -> float:
    return float("nan")


def _grade(fn: Any, policy: str, sample: Sample | None = None) -> Sample:
    s = sample or _sample()
    asyncio.run(grade(s, fn, on_error=policy))
    return s


def test_a_good_reward_and_numbers_of_any_kind() -> None:
    assert _grade(exact, "fail").reward == 1.0
    assert _grade(lambda s: True, "fail").reward == 1.0  # a bool is a number
    assert _grade(lambda s: 0, "fail").reward == 0.0


def test_fail_names_the_function_and_the_sample() -> None:
    for fn, what in ((broken, "KeyError('19')"), (async_broken, "verifier unreachable")):
        with pytest.raises(RewardError) as e:
            _grade(fn, "fail", _sample(id="q-17"))
        msg = str(e.value)
        assert f"reward function {__name__}:{fn.__name__} raised" in msg
        assert what in msg
        assert "prompt 3 (id q-17) sample 1: prompt '12+7=', response '19'" in msg
        assert "task.reward_errors" in msg
        assert e.value.function == f"{__name__}:{fn.__name__}"


def test_zero_and_drop_go_on_and_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="miles_rollout.reward"):
        zero = _grade(broken, "zero")
        drop = _grade(async_broken, "drop")
        nan = _grade(returns_nan, "zero")
    assert zero.reward == 0.0
    assert zero.status is SampleStatus.COMPLETED
    assert drop.reward is None
    assert drop.status is SampleStatus.FAILED
    assert "verifier unreachable" in drop.metadata["error"]
    assert "returned nan" in nan.metadata["reward_error"]
    ok = _grade(exact, "drop")
    assert rollout_metrics([zero, drop, nan, ok])["reward_errors"] == 3.0
    assert f"{__name__}:broken raised KeyError" in caplog.text
    assert "prompt '12+7='" in caplog.text


@pytest.mark.parametrize("policy", ["fail", "zero", "drop"])
def test_a_non_number_stops_under_every_policy(policy: str) -> None:
    for fn, kind in ((returns_text, "str '1.0'"), (returns_none, "NoneType None")):
        with pytest.raises(RewardError, match="must return a float") as e:
            _grade(fn, policy)
        assert f"{__name__}:{fn.__name__} returned {kind}" in str(e.value)
        assert "miles_rollout.types.RewardFn" in str(e.value)


def test_a_long_response_is_cut_and_a_bad_policy_refused() -> None:
    with pytest.raises(RewardError) as e:
        _grade(broken, "fail", _sample("9" * 500))
    assert "..." in str(e.value)
    assert len(str(e.value)) < 500  # excerpts, not the whole response
    with pytest.raises(ValueError, match="on_error must be one of"):
        _grade(exact, "ignore")


def test_callable_name_prefers_a_given_name() -> None:
    def fn(sample: Sample) -> float:
        return 0.0

    fn.reward_name = "pkg.tasks:MyTask.reward"  # type: ignore[attr-defined]
    assert callable_name(fn) == "pkg.tasks:MyTask.reward"
    assert callable_name(exact) == f"{__name__}:exact"
