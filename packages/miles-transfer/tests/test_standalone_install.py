"""miles-transfer installs alone (torch + stdlib) into a fresh venv and its example runs there."""

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


@pytest.mark.slow
def test_install_alone_and_run_the_example(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp_path)
    _run(py, "-m", "pip", "install", "-q", PKG, cwd=tmp_path)

    listed = _run(py, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
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
    digest = _run(env_dir / "bin" / "miles-transfer", "digest", "w.safetensors", cwd=tmp_path)
    assert digest.strip().endswith("w  bfloat16[2]")

    out = _run(py, PKG / "examples" / "standalone_sync.py", "--steps", "3", cwd=tmp_path)
    assert "verified bit-exact" in out
    assert "outputs identical" in out

    # P2P in the same torch-only venv: FSDP2 trainers -> a TP 2 engine, re-sharded, bit-exact.
    out = _run(py, PKG / "examples" / "p2p_resharding.py", "--steps", "2", cwd=tmp_path)
    assert "every engine slice bit-exact, engine outputs match" in out
