"""End to end through `miles train`: low-precision rollout (INT4 with QAT, NVFP4 with TIS) and
prompts from a user's JSONL file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("miles_quant")


def _miles(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "miles", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _train(model: Path, out: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = ["train", "arith-tiny", "--steps", "2", "--out", str(out), "--no-progress"]
    base = [
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "run.tensorboard=false",
        *sets,
    ]
    for s in base:
        args += ["--set", s]
    return _miles(args, out.parent)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_int4_rollout_with_qat_has_no_train_rollout_gap(tiny_model: Path, tmp_path: Path) -> None:
    """The engine serves int4_g128 (quantized at every update); the trainer fake-quantizes the
    same weights (trainer.qat): both compute with the same INT4 codes, so the logprob gap the
    trainer reports is float rounding only."""
    run = tmp_path / "qat"
    proc = _train(
        tiny_model,
        run,
        "engine.dtype=float32",
        "engine.weight_format=int4_g128",
        "trainer.dtype=float32",
        "trainer.qat={patterns: ['*.self_attn.*', '*.mlp.*'], group: 128}",
        "task.reward_fn=miles.rewards:exact_match",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["update/verified"] is True  # the transfer's digests of what was received
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.slow
def test_nvfp4_rollout_on_a_jsonl_dataset_logs_and_corrects_the_mismatch(
    tiny_model: Path, tmp_path: Path
) -> None:
    rows = [{"q": f"{a}+{b}=", "sum": str(a + b)} for a in range(10) for b in range(0, 10, 3)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "nvfp4"
    proc = _train(
        tiny_model,
        run,
        "engine.dtype=bfloat16",
        "engine.weight_format=nvfp4",
        "engine.keep_first_layers=1",
        "task.name=dataset",
        f"task.params={{path: {data}, template: '{{q}}', label_field: sum, seed: 1}}",
        "task.reward_fn=miles.rewards:math_equivalence",
        "trainer.loss.mismatch={level: token, mode: truncate, upper: 2.0}",
        "run.dump_samples=true",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = _rows(run)
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        # NVFP4 rollout vs the fp32 trainer: a real gap, logged and corrected by TIS.
        assert r["train/train_rollout_logprob_abs_diff"] > 1e-3
        assert 0.0 < r["train/is_weight_mean"] <= 2.0
        assert r["update/verified"] is True
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    questions = {r["q"] for r in rows}
    dumped = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(dumped) == 2 * 16
    for s in dumped:
        prompt = [t for t, m in zip(s["tokens"], s["loss_mask"]) if m == 0]
        text = tok.decode(prompt, skip_special_tokens=True)
        assert any(q in text for q in questions), text


def test_bad_dataset_row_stops_at_start_naming_file_and_row(
    tiny_model: Path, tmp_path: Path
) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"q": "1+1=", "sum": "2"}\n{"q": "2+2="}\n')
    proc = _train(
        tiny_model,
        tmp_path / "bad",
        "task.name=dataset",
        f"task.params={{path: {data}, template: '{{q}}', label_field: sum}}",
    )
    assert proc.returncode == 2
    assert f"{data}:line 2: missing field ['sum']" in proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
