"""Multi-turn rollout through the TITO session server in `miles train` (the real CLI): the
samples that reach the trainer keep the engine's ids, with tool/feedback turns masked out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _miles(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "miles", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _check_samples(run: Path, steps: int) -> None:
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(1, steps + 1))
    holes = 0
    for s in samples:
        mask, versions = s["loss_mask"], s["weight_versions"]
        first = mask.index(1)
        # Feedback turns after the first generated token: masked, and no weight version.
        holes += sum(1 for m in mask[first:] if m == 0)
        assert all((v is None) == (m == 0) for v, m in zip(versions, mask))
    assert holes > 0, "no sample had a feedback turn between generated turns"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["update/verified"] for r in rows)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_guess_number_multi_turn_tiny(tiny_model: Path, tmp_path: Path, mode: str) -> None:
    run = tmp_path / "run"
    args = ["train", "guess-number-tiny", "--steps", "2", "--out", str(run), "--no-progress"]
    for s in (
        f"model_path={tiny_model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        f"rollout.mode={mode}",
        "run.dump_samples=true",
    ):
        args += ["--set", s]
    proc = _miles(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_samples(run, 2)


@pytest.mark.slow
def test_guess_number_multi_turn_smollm2(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct with its real ChatML template (converted once, cached)."""
    run = tmp_path / "run"
    args = ["train", "guess-number-smollm2", "--steps", "1", "--out", str(run), "--no-progress"]
    for s in ("rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"):
        args += ["--set", s]
    args += ["--set", "run.dump_samples=true"]
    proc = _miles(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_samples(run, 1)
