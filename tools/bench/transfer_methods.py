"""Each `transfer.method` of `miles train` against push, on the same recipe: bytes and pause.

Why: ``push`` (gather on rank 0, bucketed full update) is the peer every other method must
beat somewhere. This script runs the same short GRPO run once per method (embedded engine,
bf16, an RL learning rate) and tabulates the ``update/*`` rows each step logged: bytes the
engine's side received, bytes rank 0 sent, the pause the engine saw, the update's wall time
in the loop, and whether the engine's digests matched bit for bit.

Laptop (tiny demo policy, about 1 min per method):
    python tools/make_tiny_model.py
    python tools/bench/transfer_methods.py --steps 4 --out runs/transfer-methods
    python tools/bench/transfer_methods.py --nproc 2 ...   # two trainer processes (torchrun)
Cluster: ``--model DIR`` with a real checkpoint, and ``--set rollout.engine_url=...`` to
measure against a server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

METHODS = ("push", "p2p", "delta")


def run(method: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One ``miles train`` run with ``transfer.method=method``; its per-step rows."""
    out = args.out / method
    sets = [
        f"transfer.method={method}",
        "engine.dtype=bfloat16",
        f"trainer.lr={args.lr}",
        "rollout.prompts_per_step=8",
        "rollout.n_samples_per_prompt=4",
        *args.set,
    ]
    if args.model:
        sets.append(f"model_path={args.model}")
    cmd = [sys.executable, "-m"]
    if args.nproc > 1:
        cmd += ["torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", "-m"]
    cmd += ["miles", "train", args.recipe, "--steps", str(args.steps), "--out", str(out)]
    cmd += ["--no-progress", *(x for s in sets for x in ("--set", s))]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"{method}.log").open("w") as log:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, env=env)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="arith-tiny")
    p.add_argument("--model", help="model_path override")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--nproc", type=int, default=1, help="trainer processes (torchrun)")
    p.add_argument("--set", action="append", default=[], help="extra recipe overrides")
    p.add_argument("--out", type=Path, default=Path("runs/transfer-methods"))
    args = p.parse_args()
    rows = {m: run(m, args) for m in METHODS}
    print(
        f"{args.recipe}, {args.steps} steps, lr {args.lr:g}, bf16 engine, {args.nproc} trainer "
        "process(es); medians over steps 2.. (step 1: delta ships a full snapshot)"
    )
    print(
        "| method | bytes to the engine | bytes sent by rank 0 | pause | update wall | verified |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for m, rs in rows.items():
        later = rs[1:] or rs

        def med(key: str, later: list[dict[str, Any]] = later) -> float:
            vals = [r[key] for r in later if key in r]
            return statistics.median(vals) if vals else float("nan")

        sent = med("update/sent_bytes") if m == "p2p" else med("update/bytes")
        pause = med("update/pause_s") if m != "push" else med("update/send_s")
        print(
            f"| {m} | {med('update/bytes'):,.0f} | {sent:,.0f} | {1e3 * pause:.1f} ms "
            f"| {1e3 * med('time/update_s'):.1f} ms "
            f"| {all(r.get('update/verified') for r in rs)} |"
        )


if __name__ == "__main__":
    main()
