"""miles-transfer installs alone (torch + stdlib) into a fresh venv and its examples run there;
then its [delta] extra, beside the user's own transformers, and the disk-delta example and CLI.

One venv and one wheel build for both (each costs about a minute on the 2-core CI machine)."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]


def _run(*cmd: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _installed(py: Path, cwd: Path) -> set[str]:
    listed = _run(py, "-m", "pip", "list", "--format=freeze", cwd=cwd).lower()
    return {line.split("==")[0] for line in listed.splitlines()}


@pytest.mark.slow
def test_install_alone_run_the_examples_then_the_delta_extra(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp_path)
    _run(py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", PKG, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("miles_transfer-*.whl")
    _run(py, "-m", "pip", "install", "-q", wheel, cwd=tmp_path)

    # Alone: nothing from Miles but miles-transfer, none of the usual heavy dependencies.
    names = _installed(py, tmp_path)
    assert "miles-transfer" in names
    assert not {n for n in names if n.startswith("miles")} - {"miles-transfer"}
    assert not names & {"transformers", "safetensors", "numpy", "requests", "aiohttp"}

    code = (
        "import sys, torch, miles_transfer, miles_transfer.checkpoint, miles_transfer.delta\n"
        "import miles_transfer.p2p.layouts, miles_transfer.p2p.transports, miles_transfer.push\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'transformers', 'safetensors', 'requests', 'aiohttp')]\n"
        "assert not bad, bad\n"
        "w = torch.ones(2, dtype=torch.bfloat16)\n"
        "miles_transfer.checkpoint.save_safetensors([('w', w)], 'w.safetensors')\n"
        "print(miles_transfer.__version__)\n"
    )
    _run(py, "-c", code, cwd=tmp_path)
    mt = env_dir / "bin" / "miles-transfer"
    digest = _run(mt, "digest", "w.safetensors", cwd=tmp_path)
    assert digest.strip().endswith("w  bfloat16[2]")

    out = _run(py, PKG / "examples" / "standalone_sync.py", "--steps", "3", cwd=tmp_path)
    assert "verified bit-exact" in out
    assert "outputs identical" in out

    # P2P in the same torch-only venv: FSDP2 trainers -> a TP 2 engine, re-sharded, bit-exact.
    out = _run(py, PKG / "examples" / "p2p_resharding.py", "--steps", "2", cwd=tmp_path)
    assert "every engine slice bit-exact, engine outputs match" in out

    # The [delta] extra: the user's own stack brings transformers; Miles brings only
    # miles-transfer[delta] (xxhash; zstd from the stdlib or backports.zstd).
    _run(py, "-m", "pip", "install", "-q", f"{wheel}[delta]", "transformers==5.24.0", cwd=tmp_path)
    names = _installed(py, tmp_path)
    assert "xxhash" in names
    assert not {n for n in names if n.startswith("miles")} - {"miles-transfer"}

    out = _run(py, PKG / "examples" / "standalone_delta.py", "--steps", "3", cwd=tmp_path)
    assert out.count("engine weights verified bit-exact") == 3
    assert "every delta update verified bit-exact" in out

    # The command line on two checkpoints that differ in one element.
    code = (
        "import torch, miles_transfer.checkpoint as mt\n"
        "a = [('w', torch.arange(64, dtype=torch.float32).bfloat16())]\n"
        "b = [('w', a[0][1].clone())]\n"
        "b[0][1][3] += 1\n"
        "import os; os.makedirs('a'); os.makedirs('b')\n"
        "mt.save_safetensors(a, 'a/model.safetensors')\n"
        "mt.save_safetensors(b, 'b/model.safetensors')\n"
    )
    _run(py, "-c", code, cwd=tmp_path)
    _run(mt, "delta", "encode", "--base", "a", "--new", "b", "--out", "d", cwd=tmp_path)
    _run(mt, "delta", "apply", "--target", "a", "--delta", "d", cwd=tmp_path)
    assert "identical" in _run(mt, "compare", "a", "b", cwd=tmp_path)
