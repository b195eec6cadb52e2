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

fp16 inputs take tables of another shape (native/quant/src/avx512_int4_tables16.h: a step
function of the 10 mantissa bits, one 64-byte lookup per 32 inputs);
tools/bench/quant_int4_f16_tables_probe.cpp checks every table of every scale dtype against the
fp32 lanes for every finite fp16 input and every scale exponent the kernel takes (5.1 billion
codes), and the group routine for every 7th fp16 group amax, every fp16 x with |x| <= amax,
every scale dtype and both group sizes.
"""

from __future__ import annotations

from pathlib import Path

from quant_probes import AVX512, run_probe


def test_int4_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    out = run_probe("quant_int4_tables_probe.cpp", (*AVX512, "avx512vbmi"), tmp_path)
    assert "int4_tab64: 0 mismatching elements of 6391630080" in out, out
    for scales in ("f32", "bf16"):
        assert f"scales {scales} g 32: 0 of 33309120 groups" in out, out
        assert f"scales {scales} g 128: 0 of 8339520 groups" in out, out
    assert "mismatching elements: 0 of 4949690560" in out, out
    assert "int4_rows_v against the contract: 0 mismatching" in out, out


def test_int4_f16_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    out = run_probe("quant_int4_f16_tables_probe.cpp", (*AVX512, "avx512vbmi"), tmp_path)
    assert "tables without the step shape: 0" in out, out
    assert "mismatching codes: 0 of 5075865600" in out, out
    # Groups left to the fp32 lanes: stored scales below 2^-13 (C <= 0) and fp16 scales whose
    # mantissa is not their table's; a change in the selection changes these counts.
    want = "mismatching group inputs: 0 of 847995904 (groups by the tables: 16463648, left"
    assert want in out, out
