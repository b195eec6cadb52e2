"""The arithmetic task's held-out partition: never sampled, fixed, the same for every seed."""

from __future__ import annotations

import random

import pytest

from miles_rollout.tasks import ArithmeticTask
from miles_rollout.types import PromptItem


def _texts(items: list[PromptItem]) -> list[str]:
    return [str(i.messages[0]["content"]) for i in items]


def test_heldout_problems_are_never_sampled() -> None:
    task = ArithmeticTask(max_operand=99, seed=1)
    held = set(_texts(task.heldout(500)))
    assert len(held) == 500  # distinct
    trained = set(_texts(task.sample(20_000)))
    assert len(trained) > 5000
    assert not held & trained
    # The warm-up's stream (make with its own rng) stays out of the partition too.
    rng = random.Random(7)
    assert not held & set(_texts([task.make(rng) for _ in range(5000)]))


def test_heldout_is_fixed_across_seeds_and_calls() -> None:
    a = ArithmeticTask(seed=1).heldout(64)
    b = ArithmeticTask(seed=2).heldout(64)
    assert _texts(a) == _texts(b) == _texts(ArithmeticTask(seed=1).heldout(64))
    assert _texts(ArithmeticTask().heldout(10)) == _texts(a)[:10]
    for item in a:
        x, y = str(item.messages[0]["content"]).rstrip("=").split("+")
        assert item.label == int(x) + int(y)
    # About the configured share: 10% of the 10,000 two-digit sums (1,011 of them).
    assert len(ArithmeticTask().heldout(1011)) == 1011
    with pytest.raises(ValueError, match=r"only 1011 of operands 0\.\.99 are held out"):
        ArithmeticTask().heldout(1012)


def test_heldout_limits_and_large_spaces() -> None:
    with pytest.raises(ValueError, match=r"only \d+ of operands 0\.\.9 are held out"):
        ArithmeticTask(max_operand=9).heldout(50)
    with pytest.raises(ValueError, match="heldout_frac is 0"):
        ArithmeticTask(heldout_frac=0.0).heldout(1)
    with pytest.raises(ValueError, match="heldout_frac must be in"):
        ArithmeticTask(heldout_frac=0.9)
    big = ArithmeticTask(max_operand=10**6, ops="+-*")
    held = big.heldout(32)
    assert len(set(_texts(held))) == 32
    assert not set(_texts(held)) & set(_texts(big.sample(2000)))
