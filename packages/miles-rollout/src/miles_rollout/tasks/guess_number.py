"""Guess the number: a multi-turn task with feedback turns, played through a TITO session.

The policy guesses a secret integer; after each wrong guess the environment answers "higher"
or "lower" (a user turn, loss mask 0) and the policy guesses again, up to ``max_turns``
guesses. Reward: 1.0 when the last guess is the secret. The feedback words hold no digits, so
the last integer of a sample's response is the last guess.

    task = GuessNumberTask(max_number=16, max_turns=3)
    gen = MultiTurnGenerate("miles_rollout.tasks.guess_number:play")
    await generate_rollout(client, tok, task.sample(8), ..., generate_fn=gen,
                           reward_fn=lambda s: task.reward(s.response, s.label))

Kept short for the tiny test model's 128-token context: a three-guess game fits.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from miles_rollout.sample import Sample
from miles_rollout.types import PromptItem

__all__ = ["GuessNumberTask", "play"]

_INT_RE = re.compile(r"-?\d+")
HIGHER, LOWER, NO_NUMBER = "higher", "lower", "a number"


def last_int(text: str | None) -> int | None:
    """The last integer in ``text`` (``None`` when there is none)."""
    found = _INT_RE.findall(text or "")
    return int(found[-1]) if found else None


@dataclass(kw_only=True, slots=True)
class GuessNumberTask:
    """Guess a secret integer in ``[1, max_number]`` with higher/lower feedback.

    Attributes:
        max_number: the secret is drawn from ``1..max_number``.
        max_turns: the most guesses (assistant turns) per game.
        seed: seed of the prompt stream; the same seed gives the same secrets.
    """

    max_number: int = 16
    max_turns: int = 3
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self._rng = random.Random(self.seed)

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` games (the secret is the label)."""
        return [
            PromptItem(
                messages=[{"role": "user", "content": f"Guess 1-{self.max_number}"}],
                label=self._rng.randint(1, self.max_number),
                metadata={"max_turns": self.max_turns},
            )
            for _ in range(n)
        ]

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """1.0 when the last integer of the response (the last guess) is the secret."""
        return 1.0 if last_int(response) == int(label) else 0.0


async def play(base_url: str, sample: Sample, request: dict[str, Any]) -> dict[str, Any]:
    """The environment's side of the game, as an agent function (``AgentFn``).

    Asks the policy for a guess through the session's chat endpoint, answers "higher",
    "lower" or "a number", until the guess is right or ``max_turns`` guesses are spent.

    Returns:
        ``{"solved": bool, "guesses": int}`` for the sample's metadata.

    Raises:
        aiohttp.ClientResponseError: a chat call failed (the sample then fails).
    """
    assert isinstance(sample.prompt, list)
    messages: list[dict[str, Any]] = [dict(m) for m in sample.prompt]
    max_turns = int(sample.metadata.get("max_turns", 3))
    secret = int(sample.label)
    async with aiohttp.ClientSession() as http:
        for turn in range(1, max_turns + 1):
            body = {**request, "messages": messages}
            async with http.post(f"{base_url}/chat/completions", json=body) as resp:
                resp.raise_for_status()
                reply = (await resp.json())["choices"][0]["message"]
            messages.append(reply)
            guess = last_int(reply.get("content"))
            if guess == secret:
                return {"solved": True, "guesses": turn}
            if turn < max_turns:
                hint = NO_NUMBER if guess is None else HIGHER if guess < secret else LOWER
                messages.append({"role": "user", "content": hint})
    return {"solved": False, "guesses": max_turns}
