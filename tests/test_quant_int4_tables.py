"""miles-quant's INT4 mantissa tables equal its fp32 path on every input a group can hold.

On CPUs with AVX512-VBMI the native kernels quantize whole bf16 INT4 groups (int4_g32,
int4_g128) without a division: the code of x / s is a table lookup on x's mantissa plus its
exponent (native/quant/src/avx512_int4_tables.h explains why that is exact). The package's own
tests compare quantize() with the PyTorch reference on chosen and random inputs; this one builds
and runs tools/bench/quant_int4_tables_probe.cpp, which checks the element routine for every
table, scale exponent and finite bf16 input (6.4 billion elements), the group routine for every
non-poisoned bf16 group amax, every bf16 x with |x| <= amax, every scale dtype and both group
sizes (4.9 billion elements; only fp16 scales may leave groups to the fp32 path), and the whole
kernel against the scalar contract on random matrices.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tools" / "bench" / "quant_int4_tables_probe.cpp"
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


def test_int4_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
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
    assert "int4_tab64: 0 mismatching elements of 6391630080" in proc.stdout, proc.stdout
    for scales in ("f32", "bf16"):
        assert f"scales {scales} g 32: 0 of 33309120 groups" in proc.stdout, proc.stdout
        assert f"scales {scales} g 128: 0 of 8339520 groups" in proc.stdout, proc.stdout
    assert "mismatching elements: 0 of 4949690560" in proc.stdout, proc.stdout
    assert "int4_rows_v against the contract: 0 mismatching" in proc.stdout, proc.stdout
