"""An OpenEnv environment server for the integration test, run in OpenEnv's own Python:
``python openenv_server.py`` prints ``PORT <n>`` once it listens on 127.0.0.1.

A real OpenEnv ``Environment`` subclass served by OpenEnv's own ``create_app`` (HTTP reset /
step / state / schema and the ``/ws`` session): guess a secret integer in 1..16 (the reset
``seed`` picks it); each step answers "higher", "lower" or "correct" with reward 1.0 and done.
"""

from __future__ import annotations

import random
import socket
import sys
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(description="an integer from 1 to 16")


class GuessObservation(Observation):
    hint: str = ""


class GuessState(State):
    secret: int = 0
    guesses: int = 0


class GuessEnv(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(secret=0, guesses=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **_: Any
    ) -> GuessObservation:
        secret = random.Random(seed).randint(1, 16)
        self._state = GuessState(episode_id=episode_id, step_count=0, secret=secret, guesses=0)
        return GuessObservation(hint="guess a number from 1 to 16", done=False, reward=None)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **_: Any
    ) -> GuessObservation:
        self._state.guesses += 1
        self._state.step_count += 1
        if action.guess == self._state.secret:
            return GuessObservation(hint="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self._state.secret else "lower"
        return GuessObservation(hint=hint, done=False, reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


def main() -> None:
    app = create_app(
        GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8
    )
    sock = socket.create_server(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
