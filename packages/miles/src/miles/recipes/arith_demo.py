"""arith-demo: the CPU demo. RL teaches a tiny policy to carry, measured on held-out sums.

``arith-tiny`` plus evaluation: the policy from ``tools/make_tiny_model.py`` (``make demo`` runs
it first) was warmed up on labels that forget the units carry more often than not, so its
greedy answers start right on about half of the two-digit sums. GRPO with the task's
exact-match reward teaches it to carry. 200 held-out sums (the task's ``heldout``: never
sampled for training) are evaluated at step 0, every 50 steps and at the end, greedily and with
4 samples each at the rollout temperature (``eval/accuracy_greedy``, ``eval/accuracy_sampled``
in ``metrics.jsonl``, drawn beside the training reward in ``reward_curve.png``). Two optimizer
steps per rollout batch (``num_minibatches: 2``: twice the updates for the same samples, the
PPO clip keeping the second on a leash) at a learning rate that peaks at 3e-4 and decays along
a cosine to 3e-5 by the last step. About 2 minutes of RL on an idle 2-core CPU.
"""

from __future__ import annotations

from typing import Any

from miles.recipes import arith_tiny


def recipe() -> dict[str, Any]:
    """The demo recipe as plain data (``arith-tiny`` with evaluation, 300 steps, a decaying lr)."""
    data = arith_tiny.recipe()
    data["name"] = "arith-demo"
    data["run"] = {**data["run"], "num_steps": 300, "plot_every": 25, "eval_every": 50}
    data["trainer"] = {
        **data["trainer"],
        "lr": 3e-4,
        "lr_decay_style": "cosine",
        "min_lr": 3e-5,
        "num_minibatches": 2,
    }
    data["eval"] = {"mode": "shared", "num_prompts": 200, "sampled_n": 4}
    return data
