"""Arithmetic: a verifiable task whose reward is exact-match success (0 or 1).

Prompts are short chat messages such as ``"37+85="``; the reference answer is the integer
result. The reward parses the response and compares it with the answer, so it is the task's
success rate, in [0, 1]. The task is deterministic given its seed, which makes runs repeatable.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_rollout.types import PromptItem

__all__ = ["ArithmeticTask", "PromptItem"]

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_INT_RE = re.compile(r"-?\d+")


@dataclass(kw_only=True, slots=True)
class ArithmeticTask:
    """Integer arithmetic on two operands.

    Attributes:
        min_operand: smallest operand (inclusive).
        max_operand: largest operand (inclusive).
        ops: operators to draw from, a subset of ``"+-*"``.
        seed: seed of the prompt stream; the same seed gives the same prompts.
    """

    min_operand: int = 0
    max_operand: int = 99
    ops: str = "+"
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must be <= max_operand ({self.max_operand})"
            )
        bad = sorted(set(self.ops) - set(_OPS))
        if not self.ops or bad:
            raise ValueError(f"ops must be a non-empty subset of '+-*'; got {self.ops!r}")
        self._rng = random.Random(self.seed)

    def make(self, rng: random.Random | None = None) -> PromptItem:
        """Draw one problem (from the task's own stream unless ``rng`` is given)."""
        r = rng or self._rng
        a = r.randint(self.min_operand, self.max_operand)
        b = r.randint(self.min_operand, self.max_operand)
        op = r.choice(self.ops)
        return PromptItem(
            messages=[{"role": "user", "content": f"{a}{op}{b}="}],
            label=_OPS[op](a, b),
        )

    def sample(self, n: int) -> list[PromptItem]:
        """Draw the next ``n`` problems of the task's stream."""
        return [self.make() for _ in range(n)]

    @staticmethod
    def answer_text(item: PromptItem) -> str:
        """The reference response for supervised warm-up."""
        return str(item.label)

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """1.0 when the response is exactly the correct integer (surrounding space ignored)."""
        text = response.strip()
        return 1.0 if _INT_RE.fullmatch(text) is not None and int(text) == int(label) else 0.0
