"""Arithmetic: a verifiable task whose reward is exact-match success (0 or 1).

Prompts are short chat messages such as ``"37+85="``; the reference answer is the integer
result. The reward parses the response and compares it with the answer, so it is the task's
success rate, in [0, 1]. The task is deterministic given its seed, which makes runs repeatable.

A fixed share of all problems (``heldout_frac``, chosen by a hash of the operands and the
operator, the same for every seed) is held out: ``sample`` never yields them and ``heldout(n)``
returns only them, so evaluation measures generalisation to problems never trained on.
"""

from __future__ import annotations

import hashlib
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
_ENUMERATE_UP_TO = 200_000  # problem spaces this small are listed whole (exact partitions)
_HELDOUT_ORDER_SEED = 0x5EED  # the held-out list's order: fixed, independent of ``seed``


def is_heldout(a: int, op: str, b: int, frac: float) -> bool:
    """Whether problem ``a op b`` is in the held-out share ``frac`` (a stable hash, no seed)."""
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < frac * 2**64


@dataclass(kw_only=True, slots=True)
class ArithmeticTask:
    """Integer arithmetic on two operands.

    Attributes:
        min_operand: smallest operand (inclusive).
        max_operand: largest operand (inclusive).
        ops: operators to draw from, a subset of ``"+-*"``.
        seed: seed of the prompt stream; the same seed gives the same prompts.
        heldout_frac: share of the problems kept out of ``sample`` for ``heldout`` (0 keeps
            none back; then ``heldout`` is unavailable).
    """

    min_operand: int = 0
    max_operand: int = 99
    ops: str = "+"
    seed: int = 0
    heldout_frac: float = 0.1
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must be <= max_operand ({self.max_operand})"
            )
        bad = sorted(set(self.ops) - set(_OPS))
        if not self.ops or bad:
            raise ValueError(f"ops must be a non-empty subset of '+-*'; got {self.ops!r}")
        if not 0.0 <= self.heldout_frac <= 0.5:
            raise ValueError(f"heldout_frac must be in [0, 0.5], got {self.heldout_frac}")
        if self._space_size() <= _ENUMERATE_UP_TO and not self._problems(heldout=False):
            raise ValueError(
                f"every problem of operands {self.min_operand}..{self.max_operand} is held out "
                f"(heldout_frac={self.heldout_frac}): widen the operand range or lower it"
            )
        self._rng = random.Random(self.seed)

    def _space_size(self) -> int:
        span = self.max_operand - self.min_operand + 1
        return span * span * len(set(self.ops))

    def _problems(self, *, heldout: bool) -> list[tuple[int, str, int]]:
        """Every problem of one partition, in a fixed order (small spaces only)."""
        lo, hi = self.min_operand, self.max_operand
        return [
            (a, op, b)
            for op in sorted(set(self.ops))
            for a in range(lo, hi + 1)
            for b in range(lo, hi + 1)
            if is_heldout(a, op, b, self.heldout_frac) is heldout
        ]

    @staticmethod
    def _item(a: int, op: str, b: int) -> PromptItem:
        return PromptItem(
            messages=[{"role": "user", "content": f"{a}{op}{b}="}], label=_OPS[op](a, b)
        )

    def make(self, rng: random.Random | None = None) -> PromptItem:
        """Draw one training problem (never a held-out one) from the task's own stream unless
        ``rng`` is given."""
        r = rng or self._rng
        while True:
            a = r.randint(self.min_operand, self.max_operand)
            b = r.randint(self.min_operand, self.max_operand)
            op = r.choice(self.ops)
            if not is_heldout(a, op, b, self.heldout_frac):
                return self._item(a, op, b)

    def sample(self, n: int) -> list[PromptItem]:
        """Draw the next ``n`` training problems of the task's stream."""
        return [self.make() for _ in range(n)]

    def heldout(self, n: int) -> list[PromptItem]:
        """``n`` distinct held-out problems, the same list for every seed (``sample`` never
        yields them).

        Raises:
            ValueError: ``heldout_frac`` is 0, or the partition has fewer than ``n`` problems.
        """
        if self.heldout_frac == 0.0:
            raise ValueError("heldout_frac is 0: no problems are held out; set task.params")
        rng = random.Random(_HELDOUT_ORDER_SEED)
        if self._space_size() <= _ENUMERATE_UP_TO:
            problems = self._problems(heldout=True)
            if n > len(problems):
                raise ValueError(
                    f"asked for {n} held-out problems but only {len(problems)} of operands "
                    f"{self.min_operand}..{self.max_operand} are held out "
                    f"(heldout_frac={self.heldout_frac})"
                )
            rng.shuffle(problems)
            return [self._item(*p) for p in problems[:n]]
        seen: dict[tuple[int, str, int], None] = {}
        while len(seen) < n:
            a = rng.randint(self.min_operand, self.max_operand)
            b = rng.randint(self.min_operand, self.max_operand)
            op = rng.choice(self.ops)
            if is_heldout(a, op, b, self.heldout_frac):
                seen[(a, op, b)] = None
        return [self._item(*p) for p in seen]

    @staticmethod
    def answer_text(item: PromptItem) -> str:
        """The reference response for supervised warm-up."""
        return str(item.label)

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """1.0 when the response is exactly the correct integer (surrounding space ignored)."""
        text = response.strip()
        return 1.0 if _INT_RE.fullmatch(text) is not None and int(text) == int(label) else 0.0
