"""End to end: `miles train` through the real CLI, one and two processes, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REQUIRED_KEYS = {
    "step",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/kl",
    "train/entropy",
    "train/clip_frac",
    "time/rollout_s",
    "time/train_s",
    "time/update_s",
}


def _miles(args: list[str], cwd: Path, *, torchrun: int = 0) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    # `python -m`, not the console scripts: under Pants those start Python with -sE, which
    # would drop the PYTHONPATH that makes e2e_rewards importable.
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={torchrun}",
            "-m",
            "miles",
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "miles", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _train_args(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "arith-tiny",
        "--set",
        f"model_path={model}",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "rollout.n_samples_per_prompt=4",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_run_directory(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    reward = "task.reward_fn=e2e_rewards:response_parity"
    proc = _miles(_train_args(tiny_model, run, 3, "--set", reward), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r.keys() >= REQUIRED_KEYS
        assert 0.0 < r["rollout/reward_mean"] < 1.0  # parity reward: mixed groups
        assert r["update/verified"] is True
        assert r["update/weight_version"] == str(r["step"])
        # On-policy first minibatch: the engine's logprobs equal the trainer's (fp32).
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert (run / "config.yaml").is_file()
    final = run / "checkpoints" / "final"
    trained = load_file(final / "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "weights never moved"
    assert (final / "tokenizer.json").is_file()


def test_two_processes_match_the_loop_contract(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run2"
    proc = _miles(_train_args(tiny_model, run, 2), tmp_path, torchrun=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["update/verified"] for r in rows)
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--set", "model_path=/nonexistent/model"],
            "model directory not found: /nonexistent/model",
        ),
        (["--set", "trainer.lrr=1"], "unknown recipe key trainer.lrr"),
        (["--set", "engine.context_length=8"], "does not fit the context length (8 tokens)"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    tiny_model: Path, tmp_path: Path, extra: list[str], message: str
) -> None:
    run = tmp_path / "bad"
    proc = _miles(_train_args(tiny_model, run, 2, *extra), tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "miles: error:" in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not run.exists()
    assert not (tmp_path / "runs").exists()


def test_malformed_recipe_file(tmp_path: Path) -> None:
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("model_path: [oops\n")
    proc = _miles(["train", str(recipe)], tmp_path)
    assert proc.returncode == 2
    assert "not valid YAML" in proc.stderr


def test_a_run_that_cannot_learn_stops_with_the_likely_causes(
    tiny_model: Path, tmp_path: Path
) -> None:
    run = tmp_path / "flat"
    extra = ["--set", "task.reward_fn=e2e_rewards:always_zero"]
    extra += ["--set", "run.no_signal_steps=2", "--set", "run.no_signal_action=stop"]
    proc = _miles(_train_args(tiny_model, run, 5, *extra), tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "miles: stopped: step 2: for 2 steps in a row" in proc.stderr
    assert "Likely causes" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in _metrics(run)] == [1]  # the run directory keeps what was done


def test_megatron_backend_tp2_under_torchrun(tiny_model: Path, tmp_path: Path) -> None:
    """trainer.backend=megatron with tensor parallelism 2 on two gloo processes: the engine gets
    the gathered HF weights bit for bit after every step, and the first step is on-policy."""
    run = tmp_path / "mg"
    extra = ["--set", "trainer.backend=megatron", "--set", "trainer.megatron.tp=2"]
    extra += ["--set", "task.reward_fn=e2e_rewards:response_parity"]
    proc = _miles(_train_args(tiny_model, run, 2, *extra), tmp_path, torchrun=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # megatron's CUDA-only scheduling advice means nothing on the CPU: not shown.
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in proc.stderr, proc.stderr[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["update/verified"] for r in rows)
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
