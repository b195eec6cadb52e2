"""`miles train --ray` through the real CLI: trainer ranks (gloo), a fleet's engines and the router
as Ray actors; every process gone after a finished run, a failed one and a Ctrl-C.

One Ray cluster serves the module (Ray takes 10-25 s to start here): the runs connect to it with
`--ray ADDRESS`; the Ctrl-C test starts its own (`--ray` alone) and checks that Ray itself stops
too. The cluster's processes are children of this test process, so every actor and every
process an actor starts is a descendant of it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_rollout.fleet.processes import wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A Ray of 2 CPUs for this module (its own temp dir: other Rays on the machine untouched)."""
    temp = tempfile.mkdtemp(prefix="miles-ray-test-")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp,
        logging_level=logging.WARNING,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )


def _args(model: Path, run: Path, steps: int, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "miles", "train", "arith-tiny", "--steps", str(steps)]
    args += ["--out", str(run)]
    for s in (
        f"model_path={model}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "ray.cpus_per_rank=0.5",  # 2 ranks + 2 engines in the 2 CPUs of the test's Ray
        "ray.cpus_per_engine=0.5",
    ):
        args += ["--set", s]
    return args + list(extra)


def _rows(run: Path) -> list[dict]:
    """The training rows of the run's metrics.jsonl (evaluation rows, if any, left out)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "rollout/reward_mean" in r]


def _tree(root: int) -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, command line)} of every descendant of ``root``."""
    procs: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        procs[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
    out: dict[int, tuple[int, str]] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmd) in procs.items():
            if ppid == parent and pid not in out:
                out[pid] = (ppid, cmd)
                frontier.append(pid)
    return out


def _is_engine(cmd: str) -> bool:
    return "miles_rollout.cli serve" in cmd


def _is_router(cmd: str) -> bool:
    return cmd.startswith(("sglang::router", "sglang-router")) or "/sglang-router " in cmd


def _actors_left(deadline_s: float) -> list[str]:
    """This module's rank and process actors still running once ``deadline_s`` has passed
    (idle workers the cluster keeps for reuse do not count)."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = [
            cmd
            for _, cmd in _tree(os.getpid()).values()
            if cmd.startswith(("ray::TrainerRank", "ray::ProcessActor"))
            or _is_engine(cmd)
            or _is_router(cmd)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def test_two_ranks_and_an_engine_fleet_as_ray_actors(
    tiny_model: Path, tmp_path: Path, ray_address: str
) -> None:
    run = tmp_path / "run"
    args = _args(tiny_model, run, 2, "--ray", ray_address, "--no-progress")
    args += ["--set", "ray.trainer_ranks=2", "--set", "fleet={engines: 2}"]
    args += ["--set", "task.reward_fn=e2e_rewards:response_parity"]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    owners: dict[int, tuple[str, str]] = {}  # engine / router pid -> (its parent, itself)
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=o, stderr=e, text=True)
        try:
            deadline = time.monotonic() + 800
            while proc.poll() is None and time.monotonic() < deadline:
                tree = _tree(os.getpid())  # the cluster (and so every actor) descends from us
                for pid, (ppid, cmd) in tree.items():
                    if _is_engine(cmd) or _is_router(cmd):
                        owners[pid] = (tree.get(ppid, (0, ""))[1], cmd)
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"the Ray cluster at {ray_address}" in stderr
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["update/verified"] is True  # both engines hold the trainer's weights, bitwise
        assert r["fleet/engines_alive"] == 2
        assert 0.0 < r["rollout/reward_mean"] < 1.0
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    assert f"run directory: {run}" in stdout
    # The engines and the router were processes of Ray actors, not of the trainer.
    engines = [parent for parent, cmd in owners.values() if _is_engine(cmd)]
    routers = [parent for parent, cmd in owners.values() if _is_router(cmd)]
    assert len(engines) == 2, owners
    assert len(routers) == 1, owners
    assert all(p.startswith("ray::ProcessActor") for p in engines + routers), owners
    assert wait_gone(list(owners), 60) == []
    assert _actors_left(60) == []


def test_a_failing_rank_stops_the_run_with_its_error(
    tiny_model: Path, tmp_path: Path, ray_address: str
) -> None:
    """A reward function (a module in the working directory, imported on the ranks) that breaks
    its contract: the same one-line error and exit status as without Ray, no run directory, no
    actor left behind."""
    (tmp_path / "ray_rewards.py").write_text("def not_a_number(sample):\n    return '1.0'\n")
    run = tmp_path / "run"
    args = _args(tiny_model, run, 2, "--ray", ray_address, "--no-progress")
    args += ["--set", "ray.trainer_ranks=2", "--set", "task.reward_fn=ray_rewards:not_a_number"]
    proc = subprocess.run(
        args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "miles: error: reward function ray_rewards:not_a_number returned str '1.0'" in proc.stderr
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not run.exists()
    assert _actors_left(60) == []


def test_ctrl_c_tears_down_actors_engines_and_the_local_ray(
    tiny_model: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = _args(tiny_model, run, 200, "--ray", "--no-progress", "--set", "fleet={engines: 1}")
    args += ["--set", "ray.num_cpus=2"]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as o, err.open("w") as e:
        # Ctrl-C's default action in the child even when this test runs with SIGINT ignored
        # (a shell's background job: `make test &`), which the child would inherit.
        proc = subprocess.Popen(
            args,
            cwd=tmp_path,
            env=_env(),
            stdout=o,
            stderr=e,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 600
            while not _rows(run) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _rows(run), err.read_text()[-3000:]
            tree = _tree(proc.pid)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    cmds = [cmd for _, cmd in tree.values()]
    # Everything ran under this launch: Ray itself, the rank, the engine, the router.
    assert any("raylet" in c for c in cmds), cmds
    assert any(c.startswith("ray::TrainerRank") for c in cmds), cmds
    assert sum(c.startswith("ray::ProcessActor") for c in cmds) == 2, cmds
    assert sum(_is_engine(c) for c in cmds) == 1, cmds
    assert sum(_is_router(c) for c in cmds) == 1, cmds
    assert proc.returncode == 130, err.read_text()[-3000:]
    assert "miles: interrupted" in err.read_text()
    assert wait_gone(list(tree), 120) == [], [tree[p][1] for p in wait_gone(list(tree), 0)]
    assert _rows(run)  # the steps done are kept
