"""Evaluation in `miles train`, through the real CLI: shared, dedicated and external modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _miles(model: Path, out: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    args = ["train", "arith-tiny", "--steps", "3", "--out", str(out), "--no-progress"]
    for s in (
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "task.reward_fn=e2e_rewards:response_parity",
        "run.eval_every=2",
        "eval.num_prompts=4",
        "eval.sampled_n=2",
        *sets,
    ):
        args += ["--set", s]
    return subprocess.run(
        [sys.executable, "-m", "miles", *args],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _eval_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "rollout/reward_mean" in r]
    assert train_steps == [1, 2, 3]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    by_step = {r["step"]: r for r in evals}
    assert len(by_step) == len(evals), "one eval row per eval step"
    return by_step


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shared_eval_at_step_zero_every_n_and_at_the_end(
    tiny_model: Path, tmp_path: Path, mode: str
) -> None:
    run = tmp_path / "run"
    proc = _miles(tiny_model, run, "eval.mode=shared", f"rollout.mode={mode}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = _eval_rows(run)
    assert sorted(evals) == [0, 2, 3]
    for r in evals.values():
        assert 0.0 <= r["eval/accuracy_greedy"] <= 1.0
        assert 0.0 <= r["eval/accuracy_sampled"] <= 1.0
        assert r["eval/failed"] == 0
    assert (run / "reward_curve.png").stat().st_size > 1000


def test_dedicated_eval_lands_late_from_snapshots(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _miles(tiny_model, run, "eval.mode=dedicated", "rollout.mode=async")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = _eval_rows(run)
    assert sorted(evals) == [0, 2, 3]
    for step, r in evals.items():
        assert 0.0 <= r["eval/accuracy_greedy"] <= 1.0
        assert 0 <= r["eval/lag_steps"] <= 3 - step
    assert not (run / "eval_snapshots").exists()


def test_external_evaluator_gets_checkpoints_and_may_skip(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _miles(
        tiny_model, run, "eval.mode=external", "eval.evaluator=e2e_rewards:checkpoint_evaluator"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = _eval_rows(run)
    assert sorted(evals) == [0, 2, 3]
    assert evals[2]["eval/skipped"] == 1.0
    for step in (0, 3):
        assert evals[step]["eval/weight_bytes"] > 1000


def test_an_evaluator_that_does_not_import_fails_at_start(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "bad"
    proc = _miles(tiny_model, run, "eval.mode=external", "eval.evaluator=nope_mod:fn")
    assert proc.returncode == 2
    assert "cannot import module 'nope_mod'" in proc.stderr
    assert not run.exists()
