"""miles-quant's FP8 mantissa tables equal its fp32 path on every input a group can hold.

On CPUs with AVX512-VBMI the native kernels quantize bf16 and fp16 inputs to FP8 (E4M3, E5M2;
every granularity) without a division: the code of x / s is a table lookup on x's mantissa plus its
exponent (native/quant/src/avx512_fp8_tables.h explains why that is exact). The package's own
tests compare quantize() with the PyTorch reference on chosen and random inputs; this one builds
and runs tools/bench/quant_fp8_tables_probe.cpp, which checks the table path byte for byte
against the fp32 path for every non-poisoned bf16 group amax and every bf16 x with |x| <= amax,
both formats (2.13 billion bytes); tools/bench/quant_fp8_f16_tables_probe.cpp does the same for
fp16 (2.02 billion bytes).
"""

from __future__ import annotations

from pathlib import Path

from quant_probes import AVX512, run_probe


def test_fp8_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    out = run_probe("quant_fp8_tables_probe.cpp", (*AVX512, "avx512vbmi"), tmp_path)
    assert "mismatching bytes: 0 of 2131783680" in out, out


def test_fp8_fp16_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    # fp16 inputs: 1025 two-lookup tables (avx512_fp8_tables.h, "fp16 inputs"), every fp16 group
    # amax x every fp16 |x| <= amax, both formats; the table lanes are also checked one by one
    # without the fp32 hand-off of steps holding an fp16 subnormal or a subnormal target.
    out = run_probe("quant_fp8_f16_tables_probe.cpp", (*AVX512, "avx512vbmi"), tmp_path)
    assert "mismatches: 0 in 2016378880 bytes" in out, out
    assert "and 1777175236 table lanes checked on their own" in out, out
