"""Multi-step arithmetic word problems, generated with a seed: a verifiable task for small LMs.

    "Mia has 4 apples. She buys 3 more. Then she gives 2 to a friend. How many apples does
    Mia have now? Answer with just the number."  -> label 5

One to ``max_steps`` operations (add, take away, groups of) on small numbers, in plain
English; every intermediate count stays positive. The reward is 1.0 when the *last* number in
the response is the answer ("Ana has 1 + 3 = 4 marbles." scores 1; a response cut off before
its answer, or one that ends on another number, scores 0). SmolLM2-135M-Instruct starts low
on one-step problems and RL on a CPU raises it (docs/benchmarks.md, "SmolLM2 word problems").
``heldout(n)`` draws from a separate seeded stream, so evaluation prompts are never training
prompts of the same seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from miles_rollout.types import PromptItem

__all__ = ["WordProblemTask", "last_number"]

_NAMES = [
    ("Mia", "She"),
    ("Tom", "He"),
    ("Ana", "She"),
    ("Leo", "He"),
    ("Zoe", "She"),
    ("Sam", "He"),
    ("Ivy", "She"),
    ("Max", "He"),
]
_ITEMS = ["apples", "pencils", "stickers", "cookies", "marbles", "books", "coins", "shells"]
_NUMBER = re.compile(r"-?\d+")
_HELDOUT_OFFSET = 1_000_003


def last_number(text: str) -> int | None:
    """The last integer in ``text`` (``None`` when there is none)."""
    found = _NUMBER.findall(text or "")
    return int(found[-1]) if found else None


@dataclass(kw_only=True, slots=True)
class WordProblemTask:
    """Word problems of 1 to ``max_steps`` operations on numbers up to ``max_number``.

    Attributes:
        max_number: the largest number a problem states (>= 2).
        max_steps: the most operations after the starting count (1 to 3).
        multiply: include "N bags of M" problems (products up to ``max_number ** 2``).
        instruction: appended to every question.
        seed: seed of the training stream (``heldout`` uses another stream).
    """

    max_number: int = 10
    max_steps: int = 2
    multiply: bool = False
    instruction: str = "Answer with just the number."
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")
        if not 1 <= self.max_steps <= 3:
            raise ValueError(f"max_steps must be 1, 2 or 3, got {self.max_steps}")
        self._rng = random.Random(self.seed)

    def make(self, rng: random.Random) -> PromptItem:
        """One problem drawn from ``rng``."""
        name, pron = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        hi = self.max_number
        if self.multiply and rng.random() < 0.25:
            bags, each = rng.randint(2, max(2, hi // 2)), rng.randint(2, hi)
            text = f"{name} has {bags} boxes with {each} {item} in each box."
            count = bags * each
            steps = 0
        else:
            count = rng.randint(1, hi)
            text = f"{name} has {count} {item}."
            steps = rng.randint(1, self.max_steps)
        for i in range(steps):
            lead = pron if i == 0 else f"Then {pron.lower()}"
            if count > 1 and rng.random() < 0.5:
                n = rng.randint(1, min(hi, count - 1))
                text += f" {lead} gives {n} to a friend."
                count -= n
            else:
                n = rng.randint(1, hi)
                text += f" {lead} finds {n} more."
                count += n
        question = f"{text} How many {item} does {name} have now? {self.instruction}".strip()
        return PromptItem(messages=[{"role": "user", "content": question}], label=count)

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` problems of the training stream."""
        return [self.make(self._rng) for _ in range(n)]

    def heldout(self, n: int) -> list[PromptItem]:
        """``n`` problems from a fixed stream separate from training."""
        rng = random.Random(self.seed + _HELDOUT_OFFSET)
        return [self.make(rng) for _ in range(n)]

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """1.0 when the last number in the response is the answer."""
        return 1.0 if last_number(response) == int(label) else 0.0
