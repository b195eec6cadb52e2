"""Reward functions by dotted path (miles.rewards): math equivalence, exact match, code tests,
and the timeout that turns a hung reward into a per-sample failure."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from typing import Any

import pytest

from miles.rewards import (
    RewardTimeoutError,
    code_tests,
    exact_match,
    extract_answer,
    extract_code,
    math_equal,
    math_equivalence,
    with_timeout,
)
from miles.tasks import load_callable
from miles_rollout import Sample


def _sample(response: str, label: Any) -> Sample:
    s = Sample(group_index=0, index=0, prompt=[{"role": "user", "content": "q"}], label=label)
    s.response = response
    return s


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The answer is 42.", "42", 1.0),
        ("so we get \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so we get \\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("Total: 1,000 apples", 1000, 1.0),
        ("She pays $18.", "Janet makes 18 dollars.\n#### 18", 1.0),
        ("#### 7", "7.0", 1.0),
        ("x = \\boxed{2x+2}", "2*(x+1)", 1.0),  # sympy: equal expressions
        ("The answer is 41", "42", 0.0),
        ("no number here", "3", 0.0),
        ("\\boxed{50\\%}", "50", 1.0),
    ],
)
def test_math_equivalence(response: str, label: Any, expected: float) -> None:
    s = _sample(response, label)
    assert math_equivalence(s) == expected
    assert "answer" in s.metadata["reward_info"]


def test_math_helpers() -> None:
    assert extract_answer("first 3 then \\boxed{x^{2}} done") == "x^{2}"
    assert extract_answer("12 apples and 5 pears, 17 in all") == "17"
    assert math_equal("1/3", "2/6")
    assert not math_equal(None, "1")


def test_exact_match_normalises_and_takes_lists() -> None:
    assert exact_match(_sample("  Paris. ", "paris")) == 1.0
    assert exact_match(_sample("Lyon", ["Paris", "Lyon"])) == 1.0
    assert exact_match(_sample("Paris is nice", "Paris")) == 0.0


def test_rewards_resolve_by_dotted_path() -> None:
    assert load_callable("miles.rewards:math_equivalence") is math_equivalence
    assert load_callable("miles.rewards:code_tests") is code_tests


def test_with_timeout_fails_a_hung_sync_or_async_reward() -> None:
    release = threading.Event()

    def hangs(sample: Any) -> float:
        release.wait()
        return 1.0

    async def hangs_async(sample: Any) -> float:
        await asyncio.Event().wait()
        return 1.0

    def fast(sample: Any) -> float:
        return 0.5

    async def run() -> None:
        for fn in (hangs, hangs_async):
            t0 = time.perf_counter()
            with pytest.raises(RewardTimeoutError, match=r"hangs.*did not return within 0.2 s"):
                await with_timeout(fn, 0.2)(_sample("x", 1))
            assert time.perf_counter() - t0 < 30  # a deadline, not a hang
        assert await with_timeout(fast, 5)(_sample("x", 1)) == 0.5
        assert await with_timeout(math_equivalence, 5)(_sample("7", 7)) == 1.0

    asyncio.run(run())
    release.set()
    assert with_timeout(fast, None) is fast
    with pytest.raises(ValueError, match="reward_timeout_s must be > 0"):
        with_timeout(fast, 0)


def test_extract_code_takes_the_last_python_block() -> None:
    text = "Here:\n```text\nnot code\n```\n```python\ndef f():\n    return 1\n```\n"
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("def g(): pass") == "def g(): pass"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the local sandbox needs bubblewrap")
def test_code_tests_run_in_a_sandbox_and_grade_pass_fail_and_timeout() -> None:
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    good = _sample("```python\ndef add(a, b):\n    return a + b\n```", tests)
    bad = _sample("```python\ndef add(a, b):\n    return a - b\n```", tests)
    loops = _sample(
        "```python\ndef add(a, b):\n    while True:\n        pass\n```",
        {"tests": tests, "timeout_s": 1.0},
    )

    async def run() -> list[float]:
        return list(await asyncio.gather(code_tests(good), code_tests(bad), code_tests(loops)))

    assert asyncio.run(run()) == [1.0, 0.0, 0.0]
    assert good.metadata["reward_info"]["passed"] is True
    assert "AssertionError" in bad.metadata["reward_info"]["stderr"]
    assert loops.metadata["reward_info"]["timed_out"] is True
    with pytest.raises(ValueError, match="label to be the test code"):
        asyncio.run(code_tests(_sample("x", 3)))


def test_a_hung_reward_fails_its_sample_with_the_reason() -> None:
    from miles_rollout import SampleStatus
    from miles_rollout.reward import grade

    release = threading.Event()

    def hangs(sample: Any) -> float:
        release.wait()
        return 1.0

    s = _sample("x", 1)
    s.status = SampleStatus.COMPLETED
    asyncio.run(grade(s, with_timeout(hangs, 0.2), on_error="drop"))
    release.set()
    assert s.status is SampleStatus.FAILED
    assert s.reward is None
    assert "test_rewards" in s.metadata["error"]
    assert "did not return within 0.2 s" in s.metadata["error"]
