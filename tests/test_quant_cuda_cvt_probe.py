"""tools/bench/quant_cuda_cvt_probe.cu keeps compiling where nvcc exists.

On a GPU it proves that the hardware FP8 conversion (cvt.rn.satfinite) the CUDA kernels use on
sm_89 and newer equals the contract's integer-bit encode on every finite and infinite fp32 input
(run on an H200: 0 of 2^32 patterns differ but NaN, which the kernels never encode). It needs a
GPU to run; this test only builds it, so the proof can be re-run as written.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (no CUDA toolkit)")
def test_the_hardware_fp8_cast_probe_compiles(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            "nvcc", "-std=c++17", "-O2", "-fmad=false", "-prec-div=true", "-ftz=false",
            f"-I{ROOT / 'native' / 'quant' / 'include'}", "-gencode", "arch=compute_90,code=sm_90",
            "-Werror", "all-warnings", str(ROOT / "tools" / "bench" / "quant_cuda_cvt_probe.cu"),
            "-o", str(tmp_path / "probe"),
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "probe").stat().st_size > 0
