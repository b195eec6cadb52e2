"""Agentic RL end to end in `miles train` (the real CLI): the ``terminal`` and
``agentic-coding`` recipes with the scripted tool-calling policy. Every episode runs through a
real TITO session server, in a real sandbox, graded by the task's real verifier, and the
trainer trains on the samples: tool outputs masked out of the loss, agentic metrics logged.

The fast runs use a tiny random Llama with SmolLM2's real tokenizer and ChatML template (the
scripted policy writes the replies, so the policy's weights do not matter for the path); the
slow one runs the ``terminal`` recipe by name with SmolLM2-135M-Instruct itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import save_tiny_smol

pytest.importorskip("miles_env")

from miles_env.backends.local import local_available

LOCAL_OK, LOCAL_WHY = local_available()
needs_sandbox = pytest.mark.skipif(not LOCAL_OK, reason=f"local sandboxes: {LOCAL_WHY}")
# The scripted roles by sample index (miles.agentic.scripted.ROLES): oracle, bad call then
# oracle, give up, never stop.
WANT_REWARDS = [1.0, 1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_smol(tmp_path_factory.mktemp("models") / "tiny-smol")


def _miles(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "miles", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def _check_run(run: Path, steps: int, tokenizer: Any, *, coding: bool) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["update/verified"]
        assert r["rollout/reward_mean"] == 0.5  # two of the four scripted roles solve the task
        assert r["rollout/failed_frac"] == 0.0
        assert r["rollout/agentic/max_turns_hit"] == 0.25  # the runaway role
        assert r["rollout/agentic/tool_errors"] == 0.5  # two bad calls in one role of four
        assert r["rollout/agentic/verifier_error"] == 0.0
        assert r["rollout/agentic/sandbox_s"] > 0
        assert 0 < r["rollout/agentic/sandbox_frac"] <= 1
        assert [k for k in r if k.startswith("rollout/agentic/reward/")]
        assert r["train/loss"] == r["train/loss"]  # trained (finite)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * steps
    for i in range(0, len(samples), 4):
        assert [s["reward"] for s in samples[i : i + 4]] == WANT_REWARDS
    for k, s in enumerate(samples):
        tokens, mask = s["tokens"], s["loss_mask"]
        first = mask.index(1)
        trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
        masked_after = tokenizer.decode([t for t, m in zip(tokens[first:], mask[first:]) if not m])
        assert all((v is None) == (m == 0) for v, m in zip(s["weight_versions"], mask))
        if k % 4 == 2:  # gives up: one reply, nothing masked after it
            assert "<tool_call>" not in trained
            assert 0 not in mask[first:]
            continue
        # Tool calls are trained; tool outputs sit between replies, masked out.
        assert "<tool_call>" in trained
        assert "<tool_response>" in masked_after
        assert "<tool_response>" not in trained
        assert "exit code" in masked_after
        if coding and k % 4 in (0, 1):
            assert '"name": "write_file"' in trained
    return rows


def _recipe_file(tmp_path: Path, module: str, model: Path) -> Path:
    f = tmp_path / f"{module}_tiny.py"
    f.write_text(
        f"from miles.recipes.{module} import recipe as base\n\n\n"
        "def recipe():\n"
        f"    r = base(model_path={str(model)!r})\n"
        '    r["engine"]["dtype"] = "float32"\n'
        '    r["trainer"]["dtype"] = "float32"\n'
        "    return r\n"
    )
    return f


@needs_sandbox
@pytest.mark.parametrize(
    ("module", "mode", "steps"),
    [
        ("terminal", "async", 2),
        pytest.param("agentic_coding", "sync", 1, marks=pytest.mark.slow),
    ],
)
def test_agentic_recipe_tiny(
    tiny_smol: Path, tmp_path: Path, module: str, mode: str, steps: int
) -> None:
    from transformers import AutoTokenizer

    from miles.agentic import plot_agentic

    run = tmp_path / "run"
    args = ["train", str(_recipe_file(tmp_path, module, tiny_smol)), "--steps", str(steps)]
    args += ["--out", str(run), "--no-progress"]
    for s in ("rollout.prompts_per_step=1", f"rollout.mode={mode}", "run.dump_samples=true"):
        args += ["--set", s]
    proc = _miles(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(tiny_smol)
    _check_run(run, steps, tok, coding=module == "agentic_coding")
    png = plot_agentic(run / "metrics.jsonl", run / "agentic.png", title=module)
    assert png is not None
    assert png.stat().st_size > 10_000


@needs_sandbox
@pytest.mark.slow
def test_terminal_recipe_smollm2(tmp_path: Path) -> None:
    """``miles train terminal`` by name: SmolLM2-135M-Instruct (converted once, cached) is
    the policy the trainer updates; one step."""
    from transformers import AutoTokenizer

    from miles_rollout.models import smollm2_dir

    run = tmp_path / "run"
    args = ["train", "terminal", "--steps", "1", "--out", str(run), "--no-progress"]
    args += ["--set", "rollout.prompts_per_step=1", "--set", "run.dump_samples=true"]
    proc = _miles(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(run, 1, AutoTokenizer.from_pretrained(smollm2_dir()), coding=False)


def test_rollout_metrics_average_reported_numbers() -> None:
    """What each episode reports in metadata['metrics'] reaches rollout/* as a mean over the
    samples that report it (reward by task: over that task's samples only)."""
    from miles_rollout import Sample, rollout_metrics

    def s(metrics: dict[str, Any] | None) -> Sample:
        return Sample(
            group_index=0, index=0, prompt="p", metadata={"metrics": metrics} if metrics else {}
        )

    out = rollout_metrics(
        [
            s({"agentic/turns": 3, "agentic/reward/a": 1.0}),
            s({"agentic/turns": 5, "agentic/reward/b": 0.0, "note": "text", "flag": True}),
            s({"agentic/turns": float("nan"), "agentic/reward/a": 0.0}),
            s(None),
        ]
    )
    assert out["agentic/turns"] == 4.0
    assert (out["agentic/reward/a"], out["agentic/reward/b"]) == (0.5, 0.0)
    assert "note" not in out
    assert "flag" not in out
