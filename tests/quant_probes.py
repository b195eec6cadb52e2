"""Builds and runs miles-quant's C++ probes (tools/bench/quant_*_probe.cpp) for the tests.

Each probe includes the kernels' headers, compares a fast path with the fp32 path over every
input it can take, and prints its counts; the tests check the counts. Shared here so that the
compiler, the flags and the skip rules are the same for every probe.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def run_probe(name: str, isa: tuple[str, ...], tmp_path: Path) -> str:
    """Compiles tools/bench/<name> with -m<flag> for each of isa and returns what it printed.

    Skips without a C++ compiler or where this CPU lacks one of isa; fails on a non-zero exit.
    """
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if not set(isa) <= cpu_flags():
        pytest.skip(f"this CPU lacks one of {isa}")
    exe = tmp_path / "probe"
    subprocess.run(
        [cxx, "-O2", "-std=c++17", *(f"-m{f}" for f in isa), "-ffp-contract=off",
         f"-I{ROOT / 'native/quant/include'}", f"-I{ROOT / 'native/quant/src'}",
         str(ROOT / "tools" / "bench" / name), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
