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

CASES = format_cases()

# Quantizes _inputs() with every case on the native backend and saves the results.
_CHILD = """
import sys, torch, miles_quant as mq
from miles_quant import _native
sys.path.insert(0, sys.argv[3])
from test_isa import CASES, _inputs
assert _native.isa() == sys.argv[1], (_native.isa(), sys.argv[1])
out = {}
for i, x in enumerate(_inputs()):
    for fmt, gran, rule in CASES:
        if gran == "16x16" and x.shape[0] % 16:
            continue
        q = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native")
        out[(i, fmt, gran, rule)] = (q.data, q.scales, q.global_scale)
torch.save(out, sys.argv[2])
"""


def _inputs() -> list[torch.Tensor]:
    """Every bf16 and fp16 pattern in wide and in narrow rows, and fp32 with low mantissa bits."""
    g = torch.Generator().manual_seed(11)
    xs = []
    for v in (all_bf16(), all_fp16()):
        shuffled = v[torch.randperm(v.numel(), generator=g)]
        finite = shuffled[torch.isfinite(shuffled.float())]
        xs += [shuffled.reshape(-1, 4096), finite[: 15 * 4144].reshape(15, 4144)]
        xs.append(finite[: 97 * 300].reshape(97, 300).float() * (1 + 2.0**-17))
    return xs


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_every_isa_gives_the_same_bits(isa: str, tmp_path: Path) -> None:
    theirs = run_with_isa(_CHILD, isa, tmp_path)
    assert isinstance(theirs, dict)
    assert theirs, "the subprocess quantized nothing"
    inputs = _inputs()
    for (i, fmt, gran, rule), (data, scales, gscale) in theirs.items():
        x = inputs[i]
        mine = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native")
        other = mq.QuantizedTensor(
            data, scales, fmt, mine.shape, mine.dtype, gran, rule, gscale, False
        )
        assert_same_quantized(mine, other)
        if i in (1, 4):  # narrower inputs: also against the reference
            ref = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="torch")
            assert_same_quantized(other, ref)
