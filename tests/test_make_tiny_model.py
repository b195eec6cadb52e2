"""The demo policy's warm-up labels: right except for a share of carrying sums, which forget
the units carry (what leaves RL something to teach); bad specs are refused."""

from __future__ import annotations

import random

import pytest
from conftest import load_tool

from miles_rollout.tasks import ArithmeticTask

tool = load_tool("make_tiny_model")


def test_warmup_labels_forget_only_the_units_carry_at_the_configured_rate() -> None:
    items = ArithmeticTask(max_operand=99, ops="+", seed=3).sample(4000)
    rng = random.Random(0)
    carrying = forgotten = 0
    for item in items:
        a, b = (int(x) for x in str(item.messages[-1]["content"]).rstrip("=").split("+"))
        answer = int(tool.warmup_answer(item, 0.55, rng))
        if (a % 10) + (b % 10) < 10:
            assert answer == a + b  # no units carry: always the sum
            continue
        carrying += 1
        assert answer in (a + b, a + b - 10)
        forgotten += answer == a + b - 10
    assert 0.40 < carrying / len(items) < 0.50  # 45 of 100 units-digit pairs carry
    assert 0.50 < forgotten / carrying < 0.60
    clean = random.Random(0)
    assert all(int(tool.warmup_answer(i, 0.0, clean)) == int(i.label) for i in items[:500])


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="carry_noise must be in"):
        tool.TinyModelSpec(carry_noise=1.5)
    with pytest.raises(ValueError, match="addition only"):
        tool.TinyModelSpec(ops="+-")
    assert tool.TinyModelSpec(ops="+-", carry_noise=0.0).carry_noise == 0.0
