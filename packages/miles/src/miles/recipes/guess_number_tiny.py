"""guess-number-tiny: multi-turn RL through the TITO session server with the tiny demo policy.

The policy guesses a secret number; the environment answers "higher" / "lower" as a user turn
(loss mask 0) and the policy guesses again, up to three guesses. Every turn's ids are the exact
ids the engine generated (``rollout.generate_fn: multi_turn``). Run ``python
tools/make_tiny_model.py`` first (``make demo`` does); the demo policy was never trained on this
game, so the run shows the multi-turn path working end to end rather than fast learning.

    miles train guess-number-tiny --steps 20
    miles train guess-number-tiny --set rollout.mode=async
"""

from __future__ import annotations

from typing import Any

from miles.recipes.arith_tiny import default_model_path


def recipe() -> dict[str, Any]:
    """The recipe as plain data."""
    return {
        "name": "guess-number-tiny",
        "model_path": default_model_path(),
        "engine": {"dtype": "float32", "max_running_requests": 128},
        # Three guesses and two feedback turns fit the tiny model's 128-token context.
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "trainer": {"lr": 2e-4, "micro_batch_size": 64, "eps": 1e-6},
        "rollout": {
            "prompts_per_step": 8,
            "n_samples_per_prompt": 8,
            "generate_fn": "multi_turn",
            "agent": "miles_rollout.tasks.guess_number:play",
        },
        "task": {"name": "guess_number", "params": {"max_number": 8, "max_turns": 3, "seed": 1}},
        "run": {"num_steps": 40, "plot_every": 10},
    }
