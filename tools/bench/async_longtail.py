"""Sync vs async `miles train` on a long-tailed workload: samples per second and trainer idle time.

Why: the asynchronous loop exists so slow trajectories never idle the trainer. This script runs
the same recipe twice, ``rollout.mode=sync`` then ``async`` (interleaved over ``--repeats``),
on a workload where 10% of the prompts need responses 8x longer than the rest, and reports
trained samples per second and the share of each step the trainer waited (``time/
trainer_idle_frac``), from the runs' own ``metrics.jsonl``.

The long tail comes from a generate function passed by dotted path (the extension point users
have): it sets ``max_new_tokens`` per sample from the prompt's metadata with ``ignore_eos``,
so lengths are exact and identical for both modes. Everything else is the demo recipe on the
demo policy (``python tools/make_tiny_model.py``).

Laptop:   .venv/bin/python tools/bench/async_longtail.py --steps 30 --repeats 2
Cluster:  the same with a real model through ``--set model_path=...`` (and a fleet).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles_rollout import GenerateContext, PromptItem, Sample
from miles_rollout.generate.single_turn import single_turn_generate
from miles_rollout.tasks import ArithmeticTask

ROOT = Path(__file__).resolve().parents[2]
SHORT, LONG, LONG_FRAC = 8, 64, 0.10


class LongTailTask:
    """The arithmetic task, with 10% of its prompts marked long (a fixed seeded choice)."""

    def __init__(self, seed: int = 1) -> None:
        self.task = ArithmeticTask(max_operand=99, ops="+", seed=seed)
        self.rng = random.Random(seed + 7)

    def sample(self, n: int) -> list[PromptItem]:
        items = self.task.sample(n)
        for item in items:
            item.metadata["max_new_tokens"] = LONG if self.rng.random() < LONG_FRAC else SHORT
        return items

    def reward(self, response: str, label: Any) -> float:
        return float(self.task.reward(response, label))


async def longtail_generate(ctx: GenerateContext, sample: Sample) -> Sample:
    """Single-turn generation with the prompt's own exact length."""
    n = int(sample.metadata.get("max_new_tokens", SHORT))
    params = dataclasses.replace(ctx.sampling_params, max_new_tokens=n, ignore_eos=True)
    return await single_turn_generate(dataclasses.replace(ctx, sampling_params=params), sample)


def _run(
    mode: str, steps: int, out: Path, extra: list[str], threads: int | None
) -> dict[str, float]:
    sets = [
        f"rollout.mode={mode}",
        "task.name=async_longtail:LongTailTask",
        "task.params={seed: 1}",
        "rollout.generate_fn=async_longtail:longtail_generate",
        "rollout.staleness_policy=keep",
        "rollout.max_staleness=2",
        "run.tensorboard=false",
        *extra,
    ]
    cmd = [sys.executable, "-m", "miles", "train", "arith-tiny", "--steps", str(steps)]
    cmd += ["--out", str(out), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    if threads is not None:
        # One OpenMP team size for the whole run: the trainer's ops and the embedded engine.
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r][1:]  # step 1 is warm-up
    seconds = sum(r["time/step_s"] for r in rows)
    n_samples = n_partial = 0
    for line in (out / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        if sample["step"] <= 1:
            continue
        n_samples += 1
        # A partial rollout: its response tokens came from more than one weight version.
        n_partial += len({v for v in sample["weight_versions"] if v is not None}) > 1
    pauses = [r["update/engine_pause_s"] for r in rows if "update/engine_pause_s" in r]
    return {
        "samples_per_s": n_samples / seconds,
        "trainer_idle_frac": statistics.mean(r["time/trainer_idle_frac"] for r in rows),
        "step_s_median": statistics.median(r["time/step_s"] for r in rows),
        "partial_frac": n_partial / max(n_samples, 1),
        "update_pause_ms_median": 1e3 * statistics.median(pauses) if pauses else float("nan"),
        "update_pause_ms_max": 1e3 * max(pauses) if pauses else float("nan"),
        "wall_s": time.perf_counter() - t0,
        "load1": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="extra recipe overrides")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for each run (default: torch's own choice)",
    )
    args = p.parse_args()
    extra = ["run.dump_samples=true", *args.set]
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                res = _run(mode, args.steps, Path(tmp) / f"{mode}-{r}", extra, args.threads)
                results[mode].append(res)
                print(mode, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
    best = {m: max(rs, key=lambda x: x["samples_per_s"]) for m, rs in results.items()}
    ratio = best["async"]["samples_per_s"] / best["sync"]["samples_per_s"]
    print(
        "| mode | samples/s | trainer idle | step median s | partial rollouts | update pause ms"
        " (median / max) |\n| --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(
            f"| {m} | {b['samples_per_s']:.1f} | {b['trainer_idle_frac']:.1%} | "
            f"{b['step_s_median']:.2f} | {b['partial_frac']:.1%} | "
            f"{b['update_pause_ms_median']:.1f} / {b['update_pause_ms_max']:.1f} |"
            for m, b in best.items()
        )
        + f"\n\nasync / sync samples per second: {ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
