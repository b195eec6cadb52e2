"""`miles train --ray` on one GPU: an SGLang engine and a trainer rank as Ray actors sharing it.

Why: the CPU machines run `--ray` with gloo ranks and embedded engines (tests/test_e2e_ray.py);
this is the check that Ray's GPU placement works with the real parts: Ray gives the SGLang
engine's actor and the trainer rank's actor the GPU (half each), SGLang starts under the engine
actor, NCCL initialises in the rank, weights reach the engine verified, and Ctrl-C leaves no
SGLang process holding the GPU. Steps (each prints PASS or FAIL; exit code = failures):

1. build     a tiny random Qwen3 (bf16, 128-char tokenizer, head_dim 64: SGLang's kernels take
             it; tools/gpu_checks/sglang_fleet_check.py builds it); nothing is downloaded.
2. fsdp      ``miles train arith-tiny --ray`` for 2 steps: FSDP2 rank (ray.gpus_per_rank 0.5)
             + a fleet of 1 SGLang engine (ray.gpus_per_engine 0.5) behind sglang-router:
             exit 0, ``update/verified`` true each step, no SGLang process left.
3. megatron  the same with ``trainer.backend=megatron``.
4. ctrl-c    a long run interrupted after its first step: exit 130, no SGLang process, no
             Ray worker of the run left.

Run from the repository root (tools/gpu_checks/ray_check.sh sets up the paths):
    python tools/gpu_checks/ray_check.py [--work-dir DIR] [--skip-megatron]
``--dry-run-cpu`` runs the same steps with the embedded engine and gloo (what the CPU machines
do to keep this script working).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_model(path: Path) -> Path:
    """The SGLang fleet check's tiny random Qwen3 checkpoint."""
    spec = importlib.util.spec_from_file_location("_fleet_check", HERE / "sglang_fleet_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.build_checkpoint(path, seed=0))


class Checks:
    """Runs steps in order, prints PASS/FAIL with times, counts failures."""

    def __init__(self) -> None:
        self.failures = 0

    def step(self, name: str, fn: Callable[[], str | None]) -> bool:
        start = time.monotonic()
        try:
            note = fn()
        except Exception as exc:
            self.failures += 1
            print(f"FAIL {name} ({time.monotonic() - start:.1f}s): {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            return False
        print(f"PASS {name} ({time.monotonic() - start:.1f}s){': ' + note if note else ''}")
        return True


def _processes(needle: str) -> list[str]:
    """Command lines of running processes that contain ``needle``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmd:
            out.append(f"{entry.name}: {cmd[:160]}")
    return out


def _gone(needle: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = _processes(needle)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def _rows(run: Path) -> list[dict]:
    """The training rows of the run's metrics.jsonl (evaluation rows left out)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "rollout/reward_mean" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default=None)
    p.add_argument("--skip-megatron", action="store_true")
    p.add_argument("--dry-run-cpu", action="store_true", help="embedded engine and gloo")
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    args = p.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ray-check-"))
    checks = Checks()
    state: dict[str, Path] = {}
    engine_needle = "miles_rollout.cli serve" if args.dry_run_cpu else "sglang.launch_server"
    if args.dry_run_cpu:
        fleet = "{engines: 1, engine_args: {num_threads: 1}}"
        gpus = ["ray.cpus_per_rank=0.5", "ray.cpus_per_engine=0.5"]
    else:
        fleet = (
            "{engines: 1, backend: sglang, startup_timeout_s: 300, sglang_args: "
            f"{{mem_fraction_static: {args.mem_fraction_static}, disable_cuda_graph: true, "
            "skip_server_warmup: true}}"
        )
        gpus = ["ray.gpus_per_rank=0.5", "ray.gpus_per_engine=0.5"]

    def miles(run: Path, steps: int, *extra: str) -> list[str]:
        argv = [sys.executable, "-m", "miles", "train", "arith-tiny", "--ray", "--no-progress"]
        argv += ["--steps", str(steps), "--out", str(run)]
        for s in (
            f"model_path={state['model']}",
            f"fleet={fleet}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            *gpus,
            *extra,
        ):
            argv += ["--set", s]
        return argv

    def build() -> str:
        state["model"] = build_model(work / "model")
        return str(state["model"])

    def train(name: str, *extra: str) -> Callable[[], str]:
        def run() -> str:
            out = work / name
            proc = subprocess.run(
                miles(out, 2, *extra), capture_output=True, text=True, timeout=480
            )
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}:\n{proc.stderr[-3000:]}")
            rows = _rows(out)
            steps = [r["step"] for r in rows]
            if steps != [1, 2] or not all(r.get("update/verified") for r in rows):
                raise RuntimeError(f"steps {steps}, rows {rows}")
            left = _gone(engine_needle, 60)
            if left:
                raise RuntimeError(f"engine processes left: {left}")
            return f"2 steps verified, reward {[round(r['rollout/reward_mean'], 3) for r in rows]}"

        return run

    def ctrl_c() -> str:
        out = work / "interrupted"
        log = (work / "interrupted.log").open("w")
        proc = subprocess.Popen(miles(out, 500), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 400
            while not _rows(out) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
            if not _rows(out):
                raise RuntimeError(f"no step finished; see {work / 'interrupted.log'}")
            if not _processes(engine_needle):
                raise RuntimeError("no engine process was running")
            proc.send_signal(signal.SIGINT)
            status = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        if status != 130:
            raise RuntimeError(f"exit {status}; see {work / 'interrupted.log'}")
        left = _gone(engine_needle, 90) + _gone("ray::TrainerRank", 30)
        if left:
            raise RuntimeError(f"left running: {left}")
        return "exit 130, nothing left"

    if not checks.step("build", build):
        return checks.failures
    checks.step("fsdp", train("fsdp"))
    if not args.skip_megatron:
        checks.step("megatron", train("megatron", "trainer.backend=megatron"))
    checks.step("ctrl-c", ctrl_c)
    print(f"{checks.failures} failure(s); work dir {work}")
    return checks.failures


if __name__ == "__main__":
    sys.exit(main())
