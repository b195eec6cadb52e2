"""miles-quant installs alone (torch only) into a fresh venv with `pip install
packages/miles-quant`: the build compiles the C++ extension, and the installed package uses it
and gives the reference's bits there."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]


def _run(*cmd: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


_CHECK = """
import sys, torch, miles_quant as mq
from miles_quant import _native
assert mq.native_available(), mq.native_error()
assert sys.prefix in _native._ext.__file__, _native._ext.__file__
bad = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'ml_dtypes', 'torchao')]
assert not bad, bad
x = (torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
for fmt in mq.FORMATS:
    a = mq.quantize(x, fmt, backend="native")
    b = mq.quantize(x, fmt, backend="torch")
    for u, v in ((a.data, b.data), (a.scales, b.scales)):
        assert torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), fmt
print(mq.__version__, _native.isa())
"""


@pytest.mark.slow  # 60-120 s: a venv, torch, and the C++ build (10-20 s on an idle machine)
def test_install_alone_builds_and_uses_the_native_extension(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "torch==2.13.0", cwd=tmp_path)
    # A build dir of our own: the checkout's packages/miles-quant/build belongs to the dev venv.
    build = tmp_path / "build"
    _run(py, "-m", "pip", "install", "-q", f"-Cbuild-dir={build}", PKG, cwd=tmp_path)

    listed = _run(py, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "miles-quant" in names
    assert not {n for n in names if n.startswith("miles")} - {"miles-quant"}
    assert not names & {"ml-dtypes", "torchao", "nanobind", "scikit-build-core"}

    version, isa = _run(py, "-c", _CHECK, cwd=tmp_path).split()
    assert version == (PKG / "src/miles_quant/version.py").read_text().split('"')[1]
    assert isa in ("avx512vbmi", "avx512", "avx2", "generic")
