"""agentic-coding: agentic RL on 4 coding tasks (file and shell tools, a sandbox per episode).

Read, edit and test code through tools in a sandbox per episode, the task's tests as the
reward, the asynchronous loop.

The prompts are the coding tasks of miles-env's built-in suite (``fix-failing-test``,
``python-bug``, ``rename-function``, ``repair-script``); the agent gets the coding tool set:
``bash``, ``read_file``, ``write_file`` and ``edit_file`` (exact-match replace), so it changes
code without shell quoting. Episodes run through the TITO session server (tool outputs masked
out of the loss) in a fresh local sandbox; the task's ``tests/test.sh`` scores the result.
Per step the loop logs ``rollout/agentic/*``.

CPU (this machine): SmolLM2-135M-Instruct is the policy the trainer updates, and the scripted
tool-calling policy (``miles.agentic.scripted``) writes the replies: the oracle's fix through
``write_file`` + ``bash`` for half of each group, a give-up or a runaway agent for the rest:

    miles train agentic-coding --steps 2
    miles train agentic-coding --set rollout.generate_fn=multi_turn \\
        --set rollout.agent=miles_env.rollout:terminal_agent        # SmolLM2 itself acts

GPU: SGLang serving a real model (Qwen3-8B class), the model acting: a recipe file calling
``recipe(model_path=...)`` with ``rollout.engine_url``, ``rollout.generate_fn: multi_turn`` and
``rollout.agent: miles_env.rollout:terminal_agent``, as in the ``terminal`` recipe's docstring;
``tools/gpu_checks/agentic_check.sh``.
"""

from __future__ import annotations

from typing import Any

CODING_TASKS = ["fix-failing-test", "python-bug", "rename-function", "repair-script"]


def recipe(model_path: str | None = None) -> dict[str, Any]:
    """The recipe as plain data; ``model_path`` None: SmolLM2 (converted on first use)."""
    from miles_rollout.models import smollm2_dir

    return {
        "name": "agentic-coding",
        "model_path": str(model_path or smollm2_dir()),
        "engine": {"dtype": "bfloat16", "max_running_requests": 64, "context_length": 4096},
        "sampling": {"temperature": 1.0, "max_new_tokens": 768},
        "trainer": {"lr": 1e-6, "dtype": "bfloat16", "micro_batch_size": 4},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 4,
            "max_concurrency": 8,
            "generate_fn": "miles.agentic.scripted:scripted_policy",
            "mode": "async",
            "max_staleness": 1,
        },
        "task": {
            "name": "harbor",
            "params": {"toolset": "coding", "tasks": CODING_TASKS, "max_turns": 8, "seed": 0},
            "reward_fn": "miles_env.rollout:episode_reward",
        },
        "run": {"num_steps": 10, "plot_every": 5},
    }
