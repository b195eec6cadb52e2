"""The PyTorch reference gives the same bits on a GPU as on CPU only if each of its fp32
divisions is an elementwise a / b. PyTorch's CUDA true division by a Python number (a CPU scalar)
computes a * (1 / b) instead, one ulp off a / b for some a: on an H200 the reference's FP8
scales amax / 448 differed so from the CPU reference and from the CUDA kernels (which matched
the CPU). This test watches the reference's operations on CPU and fails on any true division
whose divisor is a Python number; the divisions the contract needs go through
miles_quant._bits.div (a divisor tensor on the dividend's device)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _quant_testlib import format_cases
from torch.overrides import TorchFunctionMode

import miles_quant as mq
from miles_quant import _bits
from miles_quant.qat import fake_quantize_int4

_TRUE_DIVISIONS = {
    torch.div,
    torch.divide,
    torch.true_divide,
    torch.Tensor.div,
    torch.Tensor.div_,
    torch.Tensor.divide,
    torch.Tensor.true_divide,
    torch.Tensor.__truediv__,
    torch.Tensor.__itruediv__,
}


class _WatchDivisions(TorchFunctionMode):
    """Counts the torch operations and records the true divisions by a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.by_number: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        true_division = func in _TRUE_DIVISIONS and kwargs.get("rounding_mode") is None
        by_number = len(args) >= 2 and not isinstance(args[1], torch.Tensor)
        if true_division and by_number and isinstance(args[0], torch.Tensor):
            self.by_number.append(f"{getattr(func, '__name__', func)}(tensor, {args[1]!r})")
        return func(*args, **kwargs)


CASES = format_cases()


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=[f"{f}-{g}-{r}" for f, g, r in CASES])
def test_reference_divides_by_device_tensors_only(fmt: str, gran: str, rule: str | None) -> None:
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    stacked = gran in ("tensor", "1x16", "16x16")
    with _WatchDivisions() as w:
        kw = {"granularity": gran, "scale_rule": rule, "stacked": stacked}
        q = mq.quantize(x, fmt, backend="torch", **kw)  # type: ignore[arg-type]
        mq.dequantize(q, torch.float32)
    assert w.ops > 10  # the mode sees the reference's operations
    assert w.by_number == []


def test_delayed_scaler_and_qat_divide_by_device_tensors_only() -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    sc = mq.DelayedScaler("fp8_e4m3", history=2, margin=1, backend="torch")
    with _WatchDivisions() as w:
        sc.quantize(x)
        sc.quantize(x * 3)
        fake_quantize_int4(x.requires_grad_(), group=32, backend="torch").sum().backward()
    assert w.ops > 10
    assert w.by_number == []


def test_the_watch_catches_a_division_by_a_number() -> None:
    with _WatchDivisions() as w:
        torch.ones(3) / 448.0
        _bits.div(torch.ones(3), 448.0)
    assert w.by_number == ["div(tensor, 448.0)"]  # Tensor.__truediv__ reaches the mode as div


def test_div_is_the_cpu_division_bit_for_bit() -> None:
    a = torch.randint(0, 0x7F800000, (1 << 16,), generator=torch.Generator().manual_seed(2))
    x = a.to(torch.int32).view(torch.float32)
    for v in (448.0, 57344.0, 6.0, 7.0, 2688.0):
        assert torch.equal((x / v).view(torch.int32), _bits.div(x, v).view(torch.int32))
