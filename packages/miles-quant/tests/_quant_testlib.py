"""Shared helpers for the miles-quant tests (a uniquely named module: every package has tests/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import miles_quant as mq

# The native extension must be there (make setup and the Pants wheel build it); a missing build
# is a failure, not a skip, unless the run deliberately disables it.
NATIVE_DISABLED = os.environ.get("MILES_QUANT_DISABLE_NATIVE", "") == "1"


def require_native() -> None:
    if NATIVE_DISABLED:
        pytest.skip("MILES_QUANT_DISABLE_NATIVE=1")
    assert mq.native_available(), f"native extension missing: {mq.native_error()}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as a flat integer tensor of the same element size."""
    t = t.contiguous().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def all_bf16() -> torch.Tensor:
    """All 65,536 bf16 bit patterns, in order of their bits."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def all_fp16() -> torch.Tensor:
    """All 65,536 fp16 bit patterns, in order of their bits."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)


def assert_same_quantized(a: mq.QuantizedTensor, b: mq.QuantizedTensor) -> None:
    """Bit-for-bit equality of two QuantizedTensors (data, scales, global scale, metadata)."""
    assert (a.format, a.shape, a.dtype, a.granularity, a.scale_rule, a.stacked) == (
        b.format,
        b.shape,
        b.dtype,
        b.granularity,
        b.scale_rule,
        b.stacked,
    )
    assert a.data.dtype == b.data.dtype
    assert a.data.shape == b.data.shape
    assert a.scales.dtype == b.scales.dtype
    assert a.scales.shape == b.scales.shape
    diff = (bits(a.data) != bits(b.data)).nonzero()
    assert diff.numel() == 0, (
        f"{diff.numel()} data bytes differ, first at flat index {diff[:5].tolist()}"
    )
    sdiff = (bits(a.scales) != bits(b.scales)).nonzero()
    assert sdiff.numel() == 0, f"{sdiff.numel()} scales differ, first at {sdiff[:5].tolist()}"
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None and b.global_scale is not None:
        assert same_bits(a.global_scale, b.global_scale)


def format_cases() -> list[tuple[str, str, str | None]]:
    """Every (format, granularity, scale rule) combination."""
    cases = []
    for name, fmt in mq.FORMATS.items():
        for gran in fmt.granularities:
            for rule in fmt.scale_rules or (None,):
                cases.append((name, gran, rule))
    return cases


def run_with_isa(child: str, isa: str, tmp_path: Path) -> object:
    """Runs the Python code `child` in a subprocess whose kernels use the lower instruction set
    `isa` (MILES_QUANT_ISA is read once per process) and returns what it saved: the code gets
    argv [isa, dump path, this tests directory] and must torch.save its result to the dump.
    Skips where `isa` is not a lower ISA of this CPU."""
    from miles_quant import _native

    require_native()
    if _native.isa() == "generic" and isa == "avx2":
        pytest.skip("this CPU has no AVX2")
    if isa == "avx512" and _native.isa() != "avx512vbmi":
        pytest.skip("the plain AVX-512 build is only a lower ISA on a CPU with AVX512-VBMI")
    dump = tmp_path / f"{isa}.pt"
    env = {**os.environ, "MILES_QUANT_ISA": isa, "OMP_NUM_THREADS": "1"}
    here = str(Path(__file__).resolve().parent)
    r = subprocess.run(
        [sys.executable, "-c", child, isa, str(dump), here],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(dump)
