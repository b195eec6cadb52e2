"""The first hour, tested the way a new user meets it: `make demo` and the README's own-task
example, with the demo policy built exactly as `make demo` builds it (default spec) into
`~/.cache/miles` of a fresh HOME.

- The demo's promise: on prompts never trained on (the arithmetic task's held-out partition),
  greedy and sampled accuracy rise between the evaluation at step 0 and the one at the end.
- The run directory holds the outputs README.md lists (`tensorboard/` where TensorBoard is
  installed, as the README says).
- The README's "Write your own task" commands, parsed from README.md, run as written.

Slow by nature (the warm-up, then a few minutes of RL on 2 cores); the example reuses the policy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, load_tool

# A third of the demo (evaluations at 0, 50, 100; the lr's cosine spans the 100 steps), to keep
# CI inside its budget. Measured at step 100: greedy +0.195 (FSDP2) / +0.21 (Megatron TP 2),
# sampled +0.164 / +0.181 (at 150 steps +0.27 / +0.255 and +0.21 / +0.21; the full 300-step
# demo: README.md). One evaluation is 200 prompts: a difference of two has a standard deviation
# of about 0.04, so the margins below are more than two of them.
STEPS = 100
MIN_GREEDY_GAIN = 0.10
MIN_SAMPLED_GAIN = 0.10

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HOME whose ``~/.cache/miles/tiny-qwen3-arith`` is the demo policy (default spec)."""
    import torch

    home = tmp_path_factory.mktemp("home")
    tool = load_tool("make_tiny_model")
    # One thread: the same weights bit for bit as make demo's two (checked), 70 s on the idle
    # machine against 45 s, but two OpenMP threads stall behind every other process on the 2
    # cores: beside `make test`'s Pants batches this warm-up took 491 s with two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tool.ensure(
            tool.TinyModelSpec(), home / ".cache" / "miles" / "tiny-qwen3-arith", quiet=True
        )
    finally:
        torch.set_num_threads(threads)
    return home


def _env(home: Path) -> dict[str, str]:
    # One torch thread (as make test's other runs): the same held-out figures as two threads
    # (checked at 100 steps), and no OpenMP stalls beside the Pants batches.
    env = dict(os.environ, HOME=str(home), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("MILES_CACHE_DIR", None)
    # `python` and `miles` in the README's commands are this interpreter's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _readme_outputs() -> dict[str, str]:
    """The run-directory table of README.md: ``{file: what}``."""
    intro = (REPO / "README.md").read_text().split("\n## ")[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", intro, re.M)
    assert rows, "README.md lost its table of run outputs"
    return dict(rows)


def _assert_heldout_gains(run: Path) -> None:
    """Evaluations at step 0 and at the end; the end beats the start by the set margins."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/accuracy_greedy" in r}
    assert min(evals) == 0
    assert max(evals) == STEPS
    first, last = evals[0], evals[STEPS]
    summary = {s: (r["eval/accuracy_greedy"], r["eval/accuracy_sampled"]) for s, r in evals.items()}
    # Honest headroom: the warm-up leaves the policy wrong on about half the held-out problems.
    assert first["eval/accuracy_greedy"] <= 0.6, summary
    assert last["eval/accuracy_greedy"] - first["eval/accuracy_greedy"] >= MIN_GREEDY_GAIN, summary
    assert last["eval/accuracy_sampled"] - first["eval/accuracy_sampled"] >= MIN_SAMPLED_GAIN, (
        summary
    )
    assert all(r["eval/failed"] == 0 for r in evals.values())


def test_the_demo_improves_on_heldout_prompts(demo_home: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [
        "miles",
        "train",
        "arith-demo",
        "--steps",
        str(STEPS),
        "--out",
        str(run),
        "--no-progress",
    ]
    proc = subprocess.run(
        cmd, env=_env(demo_home), capture_output=True, text=True, timeout=1800, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The front door's output is the run's own: no third-party noise (torchao's CUDA-only
    # kernels failing to load on CPU, torch's enum-registration warnings).
    assert "Failed to load" not in proc.stderr, proc.stderr[:2000]
    assert "Enum subclass" not in proc.stderr, proc.stderr[:2000]
    _assert_heldout_gains(run)
    # What the README promises in the run directory is there.
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    for name, what in _readme_outputs().items():
        if name.rstrip("/") == "tensorboard" and not tensorboard:
            assert "installed" in what  # the README says when it is written
            assert not (run / name).exists()
            continue
        assert (run / name).exists(), f"README lists {name} but the run did not write it"


def test_the_demo_improves_on_megatron_tp2(demo_home: Path, tmp_path: Path) -> None:
    """The same run on the Megatron backend, TP 2 over two gloo processes under torchrun:
    the held-out gains hold as on FSDP2 (measured at step 100: greedy 0.57 -> 0.78, sampled
    0.375 -> 0.556; FSDP2 0.765 / 0.539)."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "run"
    cmd = ["torchrun", "--nproc_per_node", "2", "-m", "miles", "train", "arith-demo"]
    cmd += ["--set", "trainer.backend=megatron", "--set", "trainer.megatron.tp=2"]
    cmd += ["--steps", str(STEPS), "--out", str(run), "--no-progress"]
    proc = subprocess.run(
        cmd, env=_env(demo_home), capture_output=True, text=True, timeout=1800, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_heldout_gains(run)
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["backend"] == "megatron"


def test_the_readme_own_task_example_runs_as_written(demo_home: Path, tmp_path: Path) -> None:
    section = _readme_section("Write your own task")
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section has one block of commands to run"
    commands = [line for line in blocks[0].splitlines() if line.strip()]
    assert any(c.startswith("miles train examples/my_task/") for c in commands), commands
    # The repository root, as the README says, with runs/ written to a scratch directory.
    for name in ("tools", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=_env(demo_home),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    (metrics,) = (tmp_path / "runs").glob("three-sums-*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/reward_errors"] == 0 for r in steps)
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in steps)
