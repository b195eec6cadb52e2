"""miles-quant's quantizers vs the plain casts of torch and torchao's MX quantizer, and a memcpy.

Rows per group (same bf16 input, 32 MiB by default, one thread, outputs reused):
- ``miles-quant``: ``quantize(x, fmt, out=q)`` (native: amax, scale, cast and pack fused);
- ``torch cast``: ``dst.copy_(x)`` into a float8 buffer (no scale computed: a lower bound on
  the cast alone);
- ``torchao to_mx`` (MX group only): torchao's eager MX quantizer, the peer implementation;
- ``memcpy``: ``dst.copy_(x)`` of the bf16 input (the memory bound).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch
from suite_util import MIB, bf16_weights, prefaulted_like

import miles_quant as mq


def _methods(fmt: str, granularity: str, rule: str | None) -> dict[str, Callable[[], object]]:
    x = bf16_weights()
    q = mq.quantize(x, fmt, granularity=granularity, scale_rule=rule)
    fp8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    fp8.fill_(0)
    same = prefaulted_like(x)
    methods: dict[str, Callable[[], object]] = {
        "miles-quant": functools.partial(
            mq.quantize, x, fmt, granularity=granularity, scale_rule=rule, threads=1, out=q
        ),
        "torch cast": functools.partial(fp8.copy_, x),
        "memcpy": functools.partial(same.copy_, x),
    }
    if fmt.startswith("mx"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from torchao.prototype.mx_formats.config import ScaleCalculationMode
                from torchao.prototype.mx_formats.mx_tensor import to_mx
            mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
            methods["torchao to_mx"] = functools.partial(
                to_mx, x, torch.float8_e4m3fn, 32, mode[rule or "floor"]
            )
        except ImportError:
            pass
    return methods


FP8 = ["miles-quant", "torch cast", "memcpy"]
MX = ["miles-quant", "torchao to_mx", "torch cast", "memcpy"]


@pytest.mark.benchmark(group=f"quant fp8_e4m3 1x128 ({MIB:g} MiB bf16)")
@pytest.mark.parametrize("method", FP8)
def test_fp8_e4m3_1x128(benchmark, method):
    fn = _methods("fp8_e4m3", "1x128", None)[method]
    benchmark(fn)


@pytest.mark.benchmark(group=f"quant mxfp8_e4m3 floor ({MIB:g} MiB bf16)")
@pytest.mark.parametrize("method", MX)
def test_mxfp8_e4m3(benchmark, method):
    methods = _methods("mxfp8_e4m3", "1x32", "floor")
    if method not in methods:
        pytest.skip(f"{method}: torchao is not installed")
    benchmark(methods[method])
