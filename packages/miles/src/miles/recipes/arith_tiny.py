"""arith-tiny: GRPO on two-digit addition with the tiny demo policy, no evaluation (a base).

The quick base the tests, benchmarks and ``arith-demo`` start from: the policy is the one
``tools/make_tiny_model.py`` builds (``make demo`` runs it first), the task keeps its held-out
partition out of training, and nothing is evaluated unless ``run.eval_every`` is set.
``arith-demo`` is the demo: the same run with held-out evaluation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def default_model_path() -> str:
    """Where ``tools/make_tiny_model.py`` puts the demo policy by default."""
    cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
    return str(cache / "tiny-qwen3-arith")


def recipe() -> dict[str, Any]:
    """The demo recipe as plain data (the same shape a YAML recipe has)."""
    return {
        "name": "arith-tiny",
        "model_path": default_model_path(),
        "engine": {"dtype": "float32", "max_running_requests": 128},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "trainer": {
            "lr": 2e-4,
            "micro_batch_size": 64,
            "eps": 1e-6,
            "loss": {"clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"},
        },
        "rollout": {"prompts_per_step": 16, "n_samples_per_prompt": 8},
        "task": {"name": "arithmetic", "params": {"max_operand": 99, "ops": "+", "seed": 1}},
        "transfer": {"bucket_mb": 16, "verify": True},
        "run": {"num_steps": 100, "save_every": 0, "plot_every": 10},
    }
