"""The CPU kernels exist once per instruction set (AVX-512 with its own explicit vector code, the
same with AVX512-VBMI's byte-permute kernels, AVX2 and baseline builds of the scalar code); the
best one the CPU has is picked at run time.
Every one must give the same bits: each lower ISA runs in a subprocess (MILES_QUANT_ISA is read
once per process) on every format and input dtype, and its results are compared bit for bit
with this process's kernels and the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _quant_testlib import all_bf16, all_fp16, assert_same_quantized, format_cases, run_with_isa

import miles_quant as mq

# Every (format, granularity, rule) with the default scale dtype, and INT4 with each scale dtype
# (an fp16 scale saturates at 65504 for larger bf16 / fp32 inputs, where the codes' clamp acts).
CASES = [(*case, None) for case in format_cases()] + [
    (fmt, mq.FORMATS[fmt].granularities[0], None, sd)
    for fmt in ("int4_g32", "int4_g128")
    for sd in (torch.float32, torch.bfloat16, torch.float16)
]

# Quantizes _inputs() with every case on the native backend and saves the results.
_CHILD = """
import sys, torch, miles_quant as mq
from miles_quant import _native
sys.path.insert(0, sys.argv[3])
from test_isa import CASES, _inputs
assert _native.isa() == sys.argv[1], (_native.isa(), sys.argv[1])
out = {}
for i, x in enumerate(_inputs()):
    for fmt, gran, rule, sd in CASES:
        if gran == "16x16" and x.shape[0] % 16:
            continue
        q = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, scale_dtype=sd, backend="native")
        out[(i, fmt, gran, rule, sd)] = (q.data, q.scales, q.global_scale)
torch.save(out, sys.argv[2])
"""


# _inputs(): six with every bf16 / fp16 pattern, four with each pattern as a block amax, then
# these odd shapes in bf16, fp16 and fp32.
ODD_SHAPES = ((1, 1), (3, 17), (17, 33), (32, 699), (130, 129))
FIRST_ODD = 10
N_INPUTS = FIRST_ODD + 3 * len(ODD_SHAPES)


def against_reference(i: int) -> bool:
    """Whether _inputs()[i] is also checked against the (slow) reference: the narrow rows and
    the odd shapes."""
    return i in (1, 4) or i >= FIRST_ODD


def _edge_blocks(v: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Every pattern of v as the amax of a block: each 32 inputs hold one pattern and 31 values of
    smaller magnitude (the pattern times a random factor in [0, 1) with a random sign), so the
    scale rules meet each amax (powers of two, their neighbours, subnormals, max, Inf, NaN) in
    MX blocks, the first NVFP4 block of each pair and some INT4 / FP8 groups. Rows of 256."""
    p = v[torch.randperm(v.numel(), generator=g)]
    sign = torch.where(torch.rand(p.numel(), 31, generator=g) < 0.5, -1.0, 1.0)
    u = torch.rand(p.numel(), 31, generator=g) * sign
    rest = (p.float()[:, None] * u).to(v.dtype)
    return torch.cat([p[:, None], rest], dim=1).reshape(-1, 256)


def _inputs() -> list[torch.Tensor]:
    """Every bf16 and fp16 pattern in wide and in narrow rows, and fp32 with low mantissa bits;
    then every bf16 and fp16 pattern as a block amax (_edge_blocks), also widened to fp32; then
    small odd shapes in every dtype."""
    g = torch.Generator().manual_seed(11)
    xs = []
    for v in (all_bf16(), all_fp16()):
        shuffled = v[torch.randperm(v.numel(), generator=g)]
        finite = shuffled[torch.isfinite(shuffled.float())]
        xs += [shuffled.reshape(-1, 4096), finite[: 15 * 4144].reshape(15, 4144)]
        xs.append(finite[: 97 * 300].reshape(97, 300).float() * (1 + 2.0**-17))
    for v in (all_bf16(), all_fp16()):
        edge = _edge_blocks(v, g)
        xs += [edge, edge.float() * (1 + 2.0**-17)]
    # Odd shapes: partial groups and tiles at every edge, a zero run and a NaN in some rows.
    assert len(xs) == FIRST_ODD
    for i, (rows, cols) in enumerate(ODD_SHAPES):
        y = torch.randn(rows, cols, generator=g) * 10.0 ** (3 * i - 6)
        y.view(-1)[: cols // 2] = 0
        if rows > 2:
            y[rows // 2, cols // 3] = float("nan")
        xs += [y.to(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    assert len(xs) == N_INPUTS
    return xs


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_every_isa_gives_the_same_bits(isa: str, tmp_path: Path) -> None:
    theirs = run_with_isa(_CHILD, isa, tmp_path)
    assert isinstance(theirs, dict)
    assert theirs, "the subprocess quantized nothing"
    inputs = _inputs()
    for (i, fmt, gran, rule, sd), (data, scales, gscale) in theirs.items():
        x = inputs[i]
        kw = {"granularity": gran, "scale_rule": rule, "scale_dtype": sd}
        mine = mq.quantize(x, fmt, **kw, backend="native")
        other = mq.QuantizedTensor(
            data, scales, fmt, mine.shape, mine.dtype, gran, rule, gscale, False
        )
        assert_same_quantized(mine, other)
        if against_reference(i):
            assert_same_quantized(other, mq.quantize(x, fmt, **kw, backend="torch"))
