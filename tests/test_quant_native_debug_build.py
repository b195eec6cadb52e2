"""miles-quant's C++ compiles without optimization too (a Debug build, CMAKE_BUILD_TYPE=Debug).

At -O0 GCC's immintrin.h defines the immediate-operand intrinsics (_mm512_slli_epi32, ...) as
macros, so a template argument list inside their arguments (encode<F, false>(...)) splits into
extra macro arguments unless it is parenthesized; the optimized build never sees it. This checks
every CPU source with the ISA flags native/quant/CMakeLists.txt gives it, syntax only (no CPU
support for the ISA is needed).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from quant_probes import AVX512, ROOT

SOURCES = {
    "cpu.cpp": (),
    "cpu_isa_generic.cpp": (),
    "cpu_isa_avx2.cpp": ("avx2",),
    "cpu_isa_avx512.cpp": AVX512,
    "cpu_isa_avx512vbmi.cpp": (*AVX512, "avx512vbmi"),
}


@pytest.mark.parametrize(("source", "isa"), SOURCES.items(), ids=list(SOURCES))
def test_cpu_sources_compile_at_o0(source: str, isa: tuple[str, ...]) -> None:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = ROOT / "native" / "quant" / "src"
    proc = subprocess.run(
        [cxx, "-fsyntax-only", "-O0", "-std=c++17", "-Wall", "-Wextra", *(f"-m{f}" for f in isa),
         f"-I{ROOT / 'native/quant/include'}", f"-I{src}", str(src / source)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
