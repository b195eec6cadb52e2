"""miles-transfer[delta] installs alone (with the user's own transformers) into a fresh venv;
the disk-delta example and command line run there."""

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
def test_install_with_the_delta_extra_and_run_the_example(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp_path)
    # The user's own stack brings transformers; Miles brings only miles-transfer[delta].
    _run(py, "-m", "pip", "install", "-q", f"{PKG}[delta]", "transformers==5.24.0", cwd=tmp_path)

    listed = _run(py, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "miles-transfer" in names
    assert "xxhash" in names
    assert not {n for n in names if n.startswith("miles")} - {"miles-transfer"}

    out = _run(py, PKG / "examples" / "standalone_delta.py", "--steps", "3", cwd=tmp_path)
    assert out.count("engine weights verified bit-exact") == 3
    assert "every delta update verified bit-exact" in out

    # The command line on checkpoints the example's trainer published.
    mt = env_dir / "bin" / "miles-transfer"
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
