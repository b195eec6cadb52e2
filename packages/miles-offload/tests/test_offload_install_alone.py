"""miles-offload installs alone (torch + stdlib) into a fresh venv, builds its pager, and its
optimizer equals torch's AdamW there."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]

CHECK = """
import sys, tempfile, torch, miles_offload as mo
bad = [m for m in sys.modules if m.split(".")[0] in ("numpy", "transformers", "miles_trainer")]
assert not bad, bad
params = [torch.randn(1000, 7, requires_grad=True)]
ref = [params[0].detach().clone().requires_grad_()]
opt = mo.AdamW(params, offload="nvme", path=tempfile.mkdtemp(), bucket_mb=0.01)
torch_opt = torch.optim.AdamW(ref, foreach=False)
for k in range(3):
    params[0].grad = torch.full((1000, 7), k + 0.5)
    ref[0].grad = torch.full((1000, 7), k + 0.5)
    opt.step()
    torch_opt.step()
assert torch.equal(params[0], ref[0])
print(mo.__version__, mo.native_available(), opt.io_stats()["backend"])
"""


def _run(*cmd: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_install_alone_and_step(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp_path)
    _run(py, "-m", "pip", "install", "-q", PKG, cwd=tmp_path)
    listed = _run(py, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "miles-offload" in names
    assert not {n for n in names if n.startswith("miles")} - {"miles-offload"}
    out = _run(py, "-c", CHECK, cwd=tmp_path).split()
    assert out[1] == "True"  # the pager was compiled
    assert out[2] in ("io_uring", "threads")
