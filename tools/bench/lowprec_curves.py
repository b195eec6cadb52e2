"""Reward curves of low-precision rollout against the BF16 baseline, and the INT4 QAT gap.

Why: a low-precision rollout engine samples from a slightly different policy than the one
the trainer updates; this script measures how much (the train/rollout logprob gap the trainer
reports, ``train/train_rollout_logprob_abs_diff``) and whether the reward curve still tracks
BF16 with the loss hub's TIS correction on (``trainer.loss.mismatch``). Every run is the same
recipe, seed and prompt stream; only ``engine.weight_format`` changes. The BF16 run is the
named peer in the same invocation.

    # the format comparison: one PNG, a markdown table on stdout, runs under --out
    python tools/bench/lowprec_curves.py --model /tmp/tiny-qwen3-arith --steps 40
    # INT4 QAT end to end: the engine serves int4_g128, the trainer with and without QAT
    python tools/bench/lowprec_curves.py --model /tmp/tiny-qwen3-arith --qat --steps 20

The model is the demo policy (``python tools/make_tiny_model.py``); on a GPU cluster use a
recipe of your own with ``--recipe``. Runs go one after another (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

FORMATS = ("bf16", "fp8_block128", "mxfp8", "nvfp4", "mxfp4", "int4_g128")
GAP = "train/train_rollout_logprob_abs_diff"
REWARD = "rollout/reward_mean"


def _run(recipe: str, out: Path, sets: list[str], steps: int) -> Path:
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and sum(1 for _ in metrics.open()) >= steps:
        return metrics  # already done (resume a long comparison)
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    argv = [sys.executable, "-m", "miles", "train", recipe, "--steps", str(steps)]
    argv += ["--out", str(out), "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)
    return metrics


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.open() if line.strip()]
    return [r for r in rows if REWARD in r]


def _summary(rows: list[dict[str, Any]], last: int) -> dict[str, float]:
    rewards = [float(r[REWARD]) for r in rows]
    gaps = [float(r[GAP]) for r in rows if r.get(GAP) is not None]
    rollout = [float(r["time/rollout_s"]) for r in rows]
    clip = [float(r["train/is_clip_frac"]) for r in rows if r.get("train/is_clip_frac") is not None]
    tail = rewards[-last:]
    return {
        "final_reward": sum(tail) / len(tail),
        "auc": sum(rewards) / len(rewards),  # area under the curve per step (normalised)
        "gap_mean": sum(gaps) / max(1, len(gaps)),
        "gap_first": gaps[0] if gaps else float("nan"),
        "is_clip_frac": sum(clip) / max(1, len(clip)),
        "rollout_s": sum(rollout) / len(rollout),
    }


def _plot(curves: dict[str, list[dict[str, Any]]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows]
        rewards = [r[REWARD] for r in rows]
        window = 5
        smooth = [
            sum(rewards[max(0, i - window + 1) : i + 1])
            / len(rewards[max(0, i - window + 1) : i + 1])
            for i in range(len(rewards))
        ]
        style = "-" if name.startswith("bf16") else "--"
        ax.plot(steps, smooth, style, label=name, linewidth=2 if name.startswith("bf16") else 1.3)
        ax2.plot(steps, [r.get(GAP) for r in rows], style, label=name)
    ax.set_title(f"reward (moving mean of 5 steps){': ' + title if title else ''}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (task success rate)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax2.set_title("train/rollout logprob gap (token mean |train - rollout|)")
    ax2.set_xlabel("step")
    ax2.set_yscale("log")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="the demo policy (tools/make_tiny_model.py)")
    p.add_argument("--recipe", default="arith-tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--out", default="runs/lowprec")
    p.add_argument("--qat", action="store_true", help="INT4 QAT on vs off instead of formats")
    p.add_argument("--set", action="append", default=[], help="extra recipe overrides")
    args = p.parse_args(argv)
    out = Path(args.out)
    common = [
        f"model_path={args.model}",
        "run.plot_every=1000",
        "run.eval_every=0",
        "run.tensorboard=false",
        "run.no_signal_steps=0",
        # TIS on the train/rollout mismatch (the loss hub's token-level truncated weights).
        "trainer.loss.mismatch={level: token, mode: truncate, upper: 2.0}",
        *args.set,
    ]
    runs: dict[str, list[str]] = {}
    if args.qat:
        # fp32 on both sides: the engine's INT4 codes (fp32 scales) are then exactly those of
        # the trainer's fake quantization, so QAT on leaves only kernel rounding in the gap.
        serve = ["engine.dtype=float32", "engine.weight_format=int4_g128", "trainer.dtype=float32"]
        qat = "trainer.qat={patterns: ['*.self_attn.*', '*.mlp.*'], group: 128}"
        runs = {"int4 serve, QAT off": serve, "int4 serve, QAT on": [*serve, qat]}
        runs["fp32 serve (reference)"] = ["engine.dtype=float32", "trainer.dtype=float32"]
    else:
        for fmt in args.formats:
            runs[fmt] = ["engine.dtype=bfloat16", f"engine.weight_format={fmt}"]
    curves: dict[str, list[dict[str, Any]]] = {}
    for name, sets in runs.items():
        slug = name.split(",")[0].replace(" ", "_") + ("_qat" if "QAT on" in name else "")
        path = _run(args.recipe, out / slug, [*common, *sets], args.steps)
        curves[name] = _rows(path)
    png = out / ("qat_gap.png" if args.qat else "reward_curves.png")
    _plot(curves, png, "INT4 QAT" if args.qat else args.recipe)
    print(f"\nplot: {png}\n")
    print(
        "| run | final reward (last 10) | reward AUC / step | logprob gap mean | gap step 1 "
        "| TIS clip frac | rollout s/step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = _summary(curves[next(iter(curves))], 10)
    for name, rows in curves.items():
        s = _summary(rows, 10)
        print(
            f"| {name} | {s['final_reward']:.3f} | {s['auc']:.3f} ({s['auc'] / base['auc']:.2f}x) "
            f"| {s['gap_mean']:.2e} | {s['gap_first']:.2e} | {s['is_clip_frac']:.4f} "
            f"| {s['rollout_s']:.2f} |"
        )
    (out / ("qat_summary.json" if args.qat else "summary.json")).write_text(
        json.dumps({n: _summary(r, 10) for n, r in curves.items()}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
