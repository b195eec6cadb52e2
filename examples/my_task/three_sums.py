"""A task of your own: sums of three numbers, graded with partial credit.

Miles imports this module by the dotted paths in ``recipe.yaml`` (``three_sums:ThreeSums``,
``three_sums:closeness``): the recipe's directory and the working directory are importable.
The contracts (pinned in ``miles_rollout.types``):

- a task factory, ``factory(**params) -> Task``: here the class itself, called with
  ``task.params`` from the recipe;
- a ``Task`` has ``sample(n) -> list[PromptItem]`` (the next ``n`` prompts: chat messages plus
  whatever the reward needs, the ``label``) and ``reward(response, label) -> float``;
- optionally ``heldout(n) -> list[PromptItem]``: prompts ``sample`` never yields, for the
  evaluation rows (``run.eval_every``);
- a reward function, ``fn(sample: miles_rollout.Sample) -> float`` (or ``async``), replaces
  the task's own reward when the recipe names one (``task.reward_fn``).
"""

from __future__ import annotations

import random
import re
from typing import Any

from miles_rollout import PromptItem, Sample

_INT = re.compile(r"-?\d+")


class ThreeSums:
    """Prompts like ``"12+30+7="``; the label is the sum."""

    def __init__(self, max_operand: int = 30, seed: int = 0) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.max_operand = max_operand
        self.rng = random.Random(seed)

    def sample(self, n: int) -> list[PromptItem]:
        items = []
        for _ in range(n):
            a, b, c = (self.rng.randint(0, self.max_operand) for _ in range(3))
            items.append(
                PromptItem(messages=[{"role": "user", "content": f"{a}+{b}+{c}="}], label=a + b + c)
            )
        return items

    def reward(self, response: str, label: Any) -> float:
        """Exact match: 1.0 for the right integer, else 0.0."""
        text = response.strip()
        return 1.0 if _INT.fullmatch(text) is not None and int(text) == int(label) else 0.0


def closeness(sample: Sample) -> float:
    """Partial credit: 1.0 when exact, falling linearly to 0.0 at 20 away; 0.0 for no number.

    Graded rewards give a group's samples different rewards even when none is exactly right,
    so GRPO has something to learn from from the first step.
    """
    found = _INT.fullmatch(sample.response.strip())
    if found is None:
        return 0.0
    return max(0.0, 1.0 - abs(int(found.group()) - int(sample.label)) / 20)
