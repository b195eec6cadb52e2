"""The CPU kernels exist once per instruction set (AVX-512 with its own explicit vector code, the
same with AVX512-VBMI's byte-permute kernels, AVX2 and baseline builds of the scalar code); the
best one the CPU has is picked at run time.
Every one must give the same bits: each lower ISA runs in a subprocess (MILES_QUANT_ISA is read
once per process) on every format and input dtype, and its results are compared bit for bit
with this process's kernels and the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _quant_testlib import all_bf16, all_fp16, assert_same_quantized, format_cases, require_native

import miles_quant as mq
from miles_quant import _native

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
    require_native()
    if _native.isa() == "generic" and isa == "avx2":
        pytest.skip("this CPU has no AVX2")
    if isa == "avx512" and _native.isa() != "avx512vbmi":
        pytest.skip("the plain AVX-512 build is only a lower ISA on a CPU with AVX512-VBMI")
    dump = tmp_path / f"{isa}.pt"
    env = {**os.environ, "MILES_QUANT_ISA": isa, "OMP_NUM_THREADS": "1"}
    here = str(Path(__file__).resolve().parent)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, isa, str(dump), here],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = torch.load(dump)
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
