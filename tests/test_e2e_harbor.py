"""Harbor's own agent under ``miles train``: ``task.name: harbor`` (a built-in Harbor task) with
``rollout.agent: miles_env.integrations.harbor:harbor_agent`` runs each episode as a Harbor
trial (terminus-2: LiteLLM chat calls, commands typed into tmux in the task's container, in
Harbor's Python and Harbor's podman environment) with a session of the run's TITO session
server as its model provider; Harbor's verifier gives the reward and the samples are trained.

The model is a tiny random Llama with SmolLM2's tokenizer: what it says is noise (it never
emits its end-of-turn token, so the sampling settings carry a stop string that ends each reply
after a few tokens), so the test checks the path (what reached the session, what came back,
what was trained), not skill.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import save_tiny_smol

pytest.importorskip("miles_env")

from miles_env.backends import podman as podman_backend
from miles_env.integrations.harbor import (
    AGENT_IMAGE,
    HarborTrialConfig,
    build_agent_image,
    harbor_python,
)

TASK = Path(podman_backend.__file__).resolve().parents[1] / "tasks" / "csv-totals"


def _harbor_ready() -> str | None:
    """Why Harbor's podman trials cannot run here, or None."""
    try:
        python = harbor_python()
    except FileNotFoundError as e:
        return str(e)
    if not (python.parent / "podman-compose").exists():
        pip = python.parent / "pip"
        return f"podman-compose is not in Harbor's venv: {pip} install podman-compose"
    ok, why = podman_backend.available()
    if not ok:
        return f"podman backend: {why}"
    return None


@pytest.fixture(scope="module")
def agent_image() -> str:
    why = _harbor_ready()
    if why:
        pytest.skip(why)
    exists = subprocess.run(
        ["podman", *podman_backend._GLOBAL, "image", "exists", AGENT_IMAGE], capture_output=True
    )
    if exists.returncode != 0:
        try:
            build_agent_image()
        except RuntimeError as e:  # apt could not reach Debian
            pytest.skip(f"could not build {AGENT_IMAGE}: {e}")
    return AGENT_IMAGE


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _miles_train(recipe: Path, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``miles train RECIPE`` through the CLI's entry point, in this process (the run's
    imports are this process's: about 10 s less than a fresh ``python -m miles``)."""
    from miles.cli import main as miles_main

    monkeypatch.chdir(recipe.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the recipe's folder is added to it
    assert miles_main(["train", str(recipe), "--out", str(run), "--no-progress"]) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_miles_train_runs_harbor_agent_on_a_harbor_task(
    agent_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``miles train`` (the CLI's entry point, ``miles.cli.main``), one step of the smallest
    group (two trials)."""
    # terminus-2's prompt alone is ~900 tokens
    model = save_tiny_smol(tmp_path / "tiny-smol", max_position_embeddings=8192)
    recipe = tmp_path / "harbor_e2e.py"
    recipe.write_text(
        textwrap.dedent(
            f"""
            def recipe():
                return {{
                    "name": "harbor-e2e",
                    "model_path": {str(model)!r},
                    "engine": {{"dtype": "float32", "max_running_requests": 2}},
                    "sampling": {{"temperature": 1.0, "max_new_tokens": 24, "stop": ["e"]}},
                    "trainer": {{"lr": 1e-4, "dtype": "float32", "micro_batch_size": 2}},
                    "rollout": {{
                        "prompts_per_step": 1,
                        "n_samples_per_prompt": 2,
                        "generate_fn": "multi_turn",
                        "agent": "miles_env.integrations.harbor:harbor_agent",
                    }},
                    "task": {{
                        "name": "harbor",
                        "params": {{"tasks": ["csv-totals"], "max_turns": 2}},
                        "reward_fn": "miles_env.rollout:episode_reward",
                    }},
                    "run": {{"num_steps": 1, "dump_samples": True}},
                }}
            """
        )
    )
    run = tmp_path / "run"
    _miles_train(recipe, run, monkeypatch)
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1
    assert row["rollout/failed_frac"] == 0.0, row
    # Harbor's verifier ran tests/test.sh in each container and wrote a reward (a verifier
    # error would count here): the noise solved nothing.
    assert row["rollout/reward_errors"] == 0.0, row
    assert row["rollout/agentic/reward/csv-totals"] == 0.0
    assert row["rollout/agentic/turns"] == 2.0  # terminus-2's turn limit, from the task set
    assert row["train/samples"] == 2.0
    assert row["train/loss"] == row["train/loss"]  # trained (finite)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    instruction = (TASK / "instruction.md").read_text().strip()
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    for s in samples:
        assert s["reward"] == 0.0
        tokens, mask = s["tokens"], s["loss_mask"]
        assert all((v is None) == (m == 0) for v, m in zip(s["weight_versions"], mask))
        # The loss mask is 1 exactly on the two replies the engine generated (each at most
        # max_new_tokens), 0 on the prompt and on the feedback turn between them.
        runs = _runs(mask)
        assert len(runs) == 2, runs
        assert runs[1][1] == len(tokens)
        for a, b in runs:
            assert 1 <= b - a <= 24 + 1  # + the end-of-turn token that closes a stopped reply
        # What terminus-2 sent through the session: its own prompt with the task's
        # instruction, then (the reply not being its JSON) its feedback as the next user turn.
        prompt = tok.decode(tokens[: runs[0][0]])
        assert "command-line tasks" in prompt
        assert instruction in prompt
        between = tok.decode(tokens[runs[0][1] : runs[1][0]])
        assert "Previous response had parsing errors" in between, between


def test_harbor_trial_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="openai/<name>"):
        HarborTrialConfig(model_name="tiny")
    with pytest.raises(ValueError, match="max_turns"):
        HarborTrialConfig(max_turns=0)
    with pytest.raises(ValueError, match="timeout_s"):
        HarborTrialConfig(timeout_s=0)


def test_a_missing_harbor_python_names_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"setup_agent_frameworks\.sh harbor"):
        harbor_python(tmp_path / "nope" / "python")


def test_a_directory_that_is_not_a_harbor_task_is_refused(tmp_path: Path) -> None:
    from miles_env.integrations.harbor import run_harbor_trial

    try:
        harbor_python()  # checked first
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with pytest.raises(FileNotFoundError, match=r"no task\.toml"):
        asyncio.run(run_harbor_trial(tmp_path, "http://127.0.0.1:1/v1"))
