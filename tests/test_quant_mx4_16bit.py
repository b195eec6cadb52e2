"""miles-quant's 16-bit-lane MXFP4 path equals its fp32 path on every input it can meet.

The AVX-512 kernel quantizes whole bf16 MXFP4 blocks on 16-bit lanes when every E8M0 code of a
batch is at least 3 (native/quant/src/avx512_kernels.h, mx4_elements512_bf16_h). The package's
own tests compare quantize() with the PyTorch reference on chosen and random blocks; this one
builds and runs tools/bench/quant_mx4_16bit_probe.cpp, which checks the path byte for byte
against the fp32 path for every non-NaN bf16 input and every code 3..254 (16.5 million codes).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tools" / "bench" / "quant_mx4_16bit_probe.cpp"
NEEDED = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_16bit_mxfp4_path_equals_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if not set(NEEDED) <= _cpu_flags():
        pytest.skip(f"this CPU lacks one of {NEEDED}")
    exe = tmp_path / "probe"
    subprocess.run(
        [cxx, "-O2", "-std=c++17", *(f"-m{f}" for f in NEEDED), "-ffp-contract=off",
         f"-I{ROOT / 'native/quant/include'}", f"-I{ROOT / 'native/quant/src'}", str(PROBE),
         "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mismatching bytes: 0 of 16515072" in proc.stdout, proc.stdout
