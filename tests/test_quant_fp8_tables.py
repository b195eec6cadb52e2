"""miles-quant's FP8 mantissa tables equal its fp32 path on every input a group can hold.

On CPUs with AVX512-VBMI the native kernels quantize bf16 inputs to FP8 (E4M3, E5M2; every
granularity) without a division: the code of x / s is a table lookup on x's mantissa plus its
exponent (native/quant/src/avx512_fp8_tables.h explains why that is exact). The package's own
tests compare quantize() with the PyTorch reference on chosen and random inputs; this one builds
and runs tools/bench/quant_fp8_tables_probe.cpp, which checks the table path byte for byte
against the fp32 path for every non-poisoned bf16 group amax and every bf16 x with |x| <= amax,
both formats (2.13 billion bytes).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tools" / "bench" / "quant_fp8_tables_probe.cpp"
NEEDED = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_fp8_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
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
    assert "mismatching bytes: 0 of 2131783680" in proc.stdout, proc.stdout
