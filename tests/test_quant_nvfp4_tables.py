"""miles-quant's NVFP4 mantissa tables equal its fp32 path on every input they can meet.

On CPUs with AVX512-VBMI the native kernels quantize whole 1x16 bf16 NVFP4 batches without a
division or multiplication: block scale codes and element codes are table lookups on the
mantissas plus the exponents (native/quant/src/avx512_nvfp4_tables.h explains why that is
exact). The package's own tests compare quantize() with the PyTorch reference on chosen and
random inputs; this one builds and runs tools/bench/quant_nvfp4_tables_probe.cpp, which checks
the block codes against the contract's nvfp4_block_code for every finite bf16 block amax (above
the tensor amax too: a given global scale, quantize(..., global_scale=), meets those), which
given global scales take the tables (nvfp4_tables_cover: exactly those some bf16 tensor amax
gives), and the element bytes against the fp32 path for every non-NaN bf16 input, every
block scale code and every global-scale mantissa a bf16 tensor can have, through the one-table
loop where a global scale has one (tools/gen_nvfp4_embeddings.py) and through the 8 tables for
every scale (7.7 billion bytes).

fp16 inputs take tables of another shape (native/quant/src/avx512_nvfp4_tables16.h: a step
function of the 10 mantissa bits, two 64-byte lookups per 32 inputs);
tools/bench/quant_nvfp4_f16_tables_probe.cpp checks which global scales take them, the cached
per-mantissa tables against a fresh build, the block scale codes (a step table too) against
nvfp4_block_code for every fp16 block amax, and the element bytes against the fp32 path for every
finite fp16 input, every block scale code and 3,071 global scales (11.6 billion bytes).
"""

from __future__ import annotations

from pathlib import Path

from quant_probes import AVX512, run_probe


def test_nvfp4_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    out = run_probe("quant_nvfp4_tables_probe.cpp", (*AVX512, "avx512vbmi"), tmp_path)
    assert "nvfp4_tables_cover wrong: 0 of 97920" in out, out
    # The per-mantissa tables, patched for the exponent, against a fresh build of every scale.
    assert "nvfp4_tables_for wrong: 0 of 32643" in out, out
    assert "mismatching block codes: 0 of 33456000" in out, out
    assert "mismatching bytes: 0 of 7677902848" in out, out
    # 118 of the 128 tensor-amax mantissas, at each of the probe's 8 exponents, take the one table
    # (avx512_nvfp4_embeddings.inc); a wrong entry there is rejected and lowers this count.
    assert "global scales with one table: 944 of 1025" in out, out


def test_nvfp4_f16_tables_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    out = run_probe("quant_nvfp4_f16_tables_probe.cpp", (*AVX512, "avx512vbmi"), tmp_path)
    # The scale of every finite non-zero fp16 amax is covered, nothing one ulp off one is.
    assert "nvfp4_covered_mantissa16 wrong: 0 of 95230" in out, out
    assert "nvfp4_tab16_for wrong: 0 of 31743 (tables without the step shape: 0)" in out, out
    # Block codes by the bs step table: every fp16 block amax, computed and given scale.
    assert "mismatching block codes: 0 of 198116352" in out, out
    want = "mismatching bytes: 0 of 11600813056 (finite fp16 inputs x block codes x 3071 global"
    assert want in out, out
