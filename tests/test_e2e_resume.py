"""`miles train --resume RUN_DIR`: a run stopped and resumed matches the uninterrupted one bit
for bit (deterministic sync mode), and an async run killed with SIGKILL resumes with its
buffered groups intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(1200)


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles", *args]


def _train(model: Path, out: Path, steps: int, *sets: str) -> list[str]:
    args = ["train", "arith-tiny", "--steps", str(steps), "--out", str(out), "--no-progress"]
    for s in (
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "task.reward_fn=e2e_rewards:response_parity",
        *sets,
    ):
        args += ["--set", s]
    return _cmd(*args)


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/") and not k.endswith("_s")}


@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.slow)])
def test_resumed_run_matches_the_uninterrupted_one(
    tiny_model: Path, tmp_path: Path, backend: str
) -> None:
    sets = ("run.deterministic=true", "run.save_every=2", f"trainer.backend={backend}")
    whole, split = tmp_path / "whole", tmp_path / "split"
    _run(_train(tiny_model, whole, 3, *sets), tmp_path)
    _run(_train(tiny_model, split, 2, *sets), tmp_path)
    _run(_cmd("train", "--resume", str(split), "--steps", "3", "--no-progress"), tmp_path)
    a, b = _rows(whole), _rows(split)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]
    wa = load_file(whole / "checkpoints" / "final" / "model.safetensors")
    wb = load_file(split / "checkpoints" / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_killed_async_run_resumes_with_its_buffer(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    sets = (
        "rollout.mode=async",
        "rollout.max_staleness=100",
        "rollout.staleness_policy=keep",
        "run.save_every=1",
        "run.dump_samples=true",
    )
    proc = subprocess.Popen(
        _train(tiny_model, run, 50, *sets),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpt = run / "trainer" / "step_000002" / "meta.json"
    deadline = time.monotonic() + 600
    while not ckpt.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # mid-run: no cleanup of any kind
    proc.wait(timeout=60)
    assert ckpt.is_file(), "the run never wrote its step-2 checkpoint"
    from miles_trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run / "trainer")
    assert latest is not None
    state = torch.load(latest / "client_state.pt", weights_only=False)
    buffered = [g["samples"] for g in state["source"]["buffered"]]
    assert buffered, "the checkpoint holds no buffered groups"
    step = int(latest.name.split("_")[1])

    _run(_cmd("train", "--resume", str(run), "--steps", str(step + 2), "--no-progress"), tmp_path)
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, step + 3))
    # The groups that waited in the buffer when the process died are the next ones trained.
    trained = [
        json.loads(line)
        for line in (run / "samples.jsonl").read_text().splitlines()
        if json.loads(line)["step"] > step
    ]
    trained_tokens = [s["tokens"] for s in trained]
    for group in buffered[:4]:
        for sample in group:
            assert sample.tokens in trained_tokens
