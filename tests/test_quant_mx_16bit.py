"""miles-quant's 16-bit-lane MX paths equal its fp32 path on every input they can meet.

The AVX-512 kernel quantizes whole bf16 MX blocks (MXFP4, MXFP8 E4M3 and E5M2) on 16-bit lanes
when every E8M0 code of a batch is at least 3, 11 or 18, and whole fp16 blocks for every code
(vectors holding an fp16 subnormal go to the fp32 path): native/quant/src/avx512_mx.h,
mx4_elements512_h and mx8_elements512_h. The package's own tests compare quantize() with the
PyTorch reference on chosen and random blocks; this one builds and runs
tools/bench/quant_mx_16bit_probe.cpp, which checks the 16-bit paths byte for byte against the
fp32 path for every non-NaN bf16 input and every code from those minima to 254 (79.6 million
bytes), and for every non-NaN fp16 input and every code from 64 to 160 (a block of fp16 inputs
has one in 88..142; 30.8 million bytes). On CPUs with AVX512-VBMI the probe is built with it and
also checks the bf16 byte-lane paths (native/quant/src/avx512_bytes.h): MXFP4
(mx4_elements512_bf16_b) for every code from 5 to 254, MXFP8 E4M3 and E5M2
(mx8_elements512_bf16_b) from 11 and 18 (39.7 million bytes more).
"""

from __future__ import annotations

from pathlib import Path

from quant_probes import AVX512, cpu_flags, run_probe


def test_16bit_mx_paths_equal_the_fp32_path_exhaustively(tmp_path: Path) -> None:
    vbmi = "avx512vbmi" in cpu_flags()
    isa = (*AVX512, "avx512vbmi") if vbmi else AVX512
    out = run_probe("quant_mx_16bit_probe.cpp", isa, tmp_path)
    # 16-bit paths, bf16: 79,560,704 bytes; fp16: 97 codes x 124 batches x 2 masks x (256 + 2 x
    # 512) bytes; byte paths: 250 MXFP4 codes x 32,768 bytes, 244 E4M3 and 237 E5M2 codes x
    # 65,536 bytes.
    checked = 79560704 + 97 * 124 * 2 * (256 + 2 * 512)
    checked += 250 * 32768 + (244 + 237) * 65536 if vbmi else 0
    assert f"mismatching bytes: 0 of {checked} " in out, out
