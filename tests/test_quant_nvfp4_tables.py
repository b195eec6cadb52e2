"""miles-quant's NVFP4 mantissa tables equal its fp32 path on every input they can meet.

On CPUs with AVX512-VBMI the native kernels quantize whole 1x16 bf16 NVFP4 batches without a
division or multiplication: block scale codes and element codes are table lookups on the
mantissas plus the exponents (native/quant/src/avx512_nvfp4_tables.h explains why that is
exact). The package's own tests compare quantize() with the PyTorch reference on chosen and
random inputs; this one builds and runs tools/bench/quant_nvfp4_tables_probe.cpp, which checks
the block codes against the contract's nvfp4_block_code for every bf16 block amax up to the
tensor amax, and the element bytes against the fp32 path for every non-NaN bf16 input, every
block scale code and every global-scale mantissa a bf16 tensor can have (4.0 billion bytes).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tools" / "bench" / "quant_nvfp4_tables_probe.cpp"
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


def test_nvfp4_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
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
    assert "mismatching block codes: 0 of 20307984" in proc.stdout, proc.stdout
    assert "mismatching bytes: 0 of 3996876800" in proc.stdout, proc.stdout
