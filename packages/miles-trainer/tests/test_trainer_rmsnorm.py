"""The trainer's low-precision RMSNorm against transformers' module, and the malloc setting."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from miles_trainer._malloc import keep_freed_memory
from miles_trainer.ops.rmsnorm import RMSNormFunction


def _hf_norm(hidden: int, dtype: torch.dtype) -> Any:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    norm = Qwen3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(hidden))
    return norm.to(dtype)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((4, 33, 96), torch.bfloat16), ((4, 33, 3, 32), torch.bfloat16), ((4, 33, 96), torch.float16)],
)
def test_forward_bits_equal_transformers_and_backward_is_close(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    hf = _hf_norm(shape[-1], dtype)
    x = (3 * torch.randn(shape)).to(dtype)
    # A common offset per row: the backward adds LayerNorm's mean term back (ops/rmsnorm.py).
    grad = (torch.randn(shape) + 0.5).to(dtype)

    def run(fn: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xi = x.clone().requires_grad_()
        hf.weight.grad = None
        out = fn(xi)  # type: ignore[operator]
        out.backward(grad)
        assert xi.grad is not None
        assert hf.weight.grad is not None
        return out.detach(), xi.grad, hf.weight.grad.clone()

    want_out, want_dx, want_dw = run(hf)
    got_out, got_dx, got_dw = run(
        lambda xi: RMSNormFunction.apply(xi, hf.weight, hf.variance_epsilon)
    )
    assert got_out.dtype == dtype
    assert torch.equal(got_out, want_out)  # the forward is bit for bit transformers'
    # Gradients: exact maths in float64 on the same bf16 inputs; both are within bf16 rounding.
    x64 = x.double().requires_grad_()
    w64 = hf.weight.detach().double().requires_grad_()
    out64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + hf.variance_epsilon))
    out64.backward(grad.double())
    assert x64.grad is not None
    assert w64.grad is not None
    for got, want, exact in ((got_dx, want_dx, x64.grad), (got_dw, want_dw, w64.grad)):
        scale = exact.abs().max().item()
        err_got = (got.double() - exact).abs().max().item() / scale
        err_hf = (want.double() - exact).abs().max().item() / scale
        assert err_got < 2e-2, err_got
        assert err_got <= 2 * err_hf + 1e-3, (err_got, err_hf)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_applies_on_glibc() -> None:
    assert keep_freed_memory() is True
