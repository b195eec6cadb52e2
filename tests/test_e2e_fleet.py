"""`miles train` with a fleet of engine processes behind the real sglang-router: weights reach
every engine, and a run survives an engine killed mid-run (a replacement joins and catches up)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
STEPS = 6


def _args(model: Path, run: Path, steps: int, *sets: str) -> list[str]:
    args = [sys.executable, "-m", "miles", "train", "arith-tiny", "--steps", str(steps)]
    args += ["--out", str(run), "--no-progress"]
    for s in (
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.mode=async",
        "run.dump_samples=true",
        "task.reward_fn=e2e_rewards:response_parity",
        *sets,
    ):
        args += ["--set", s]
    return args


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _engine_pids(parent: int) -> list[int]:
    """PIDs of `miles-rollout serve` processes whose parent is ``parent``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and "serve" in cmd and "miles_rollout" in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def test_fleet_engine_killed_mid_run(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    sets = ("fleet={engines: 2, replace_dead_engines: true}", "rollout.max_staleness=8")
    proc = subprocess.Popen(
        _args(tiny_model, run, STEPS, *sets),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not _rows(run) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _rows(run), "the run did not finish its first step"
        engines = _engine_pids(proc.pid)
        assert len(engines) == 2, engines
        os.kill(engines[0], signal.SIGKILL)
        # Steps still to run after the kill (a death is in the rows of steps after it).
        steps_at_kill = len(_rows(run))
        _out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert steps_at_kill < STEPS, "the run ended before the engine was killed"
    # Every update reached every live engine, bit for bit (a replacement included once it
    # joined; whether it joins within these steps depends on the machine's speed: the
    # catch-up itself is tested in packages/miles/tests/test_fanout.py).
    assert all(r["update/verified"] for r in rows)
    assert rows[-1]["fleet/engine_deaths"] == 1
    assert rows[-1]["fleet/engines_started"] in (2, 3)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    # Nothing double-counted: each step trained exactly one batch; versions never ran ahead.
    assert [sum(s["step"] == k for s in samples) for k in range(1, STEPS + 1)] == [16] * STEPS
    assert all(s["staleness"] >= 0 for s in samples)
    assert _engine_pids(proc.pid) == []  # the fleet stopped what it started
