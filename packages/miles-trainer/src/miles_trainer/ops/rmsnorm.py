"""RMSNorm for training on CPU: transformers' forward bits, a shorter backward.

Why: HF's RMSNorm (``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)``) is about
eight elementwise ops, and autograd differentiates each one, keeping float32 copies of the
activations. In a bf16 train step on CPU, where the GEMMs are fast, the 25 norms of the `gen`
benchmark model (4 per layer: input, post-attention, q and k) took about a third of the step
(28 ms forward + backward per ``[5696, 384]`` norm, one thread). Here the forward is torch's
fused ``rms_norm`` kernel (the same bits as HF's, checked by the tests). The input gradient
comes from torch's fused LayerNorm backward kernel with its mean term taken back out (bf16 /
fp16: one pass with float32 inside, 1.3-1.6 instead of 2.6-3.0 ms for that norm on the AMD
EPYC) or, in float32, from ``rstd * (g - x_hat * mean(g * x_hat))`` written out.

`rms_norm_forward` / `rms_norm_backward` are the two halves as plain functions, for fused ops
that normalise inside their own autograd function (`ops.attention_block`).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["RMSNormFunction", "rms_norm_backward", "rms_norm_forward", "use_fast_rms_norm"]


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's RMSNorm over the last dim, bit for bit: ``(weight * n, n, rstd)``.

    ``n = (float32(x) * rstd).to(x.dtype)`` with ``rstd = rsqrt(mean(float32(x)^2) + eps)``
    (float32, ``[..., 1]``); the output is ``weight * n`` in the input dtype.
    """
    n, rstd = torch._fused_rms_norm(x, [x.shape[-1]], None, eps)
    return weight * n, n, rstd


def rms_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    n: torch.Tensor,
    rstd: torch.Tensor,
    *,
    need_x: bool = True,
    need_weight: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `rms_norm_forward`'s output: ``(grad_x, grad_weight)`` (None if not needed).

    ``grad_weight = sum(grad * n)`` over all rows (in the weight's dtype, as autograd's).
    ``grad_x = rstd * g - rstd^3 * mean(g * x) * x`` with ``g = grad * weight``: torch's fused
    LayerNorm backward given a zero mean computes all of it but a ``- rstd * mean(g)`` term
    (LayerNorm's gradient through its mean), which is added back per row; in bf16/fp16 that
    kernel keeps float32 inside, so the result is rounded twice (the kernel's output and the
    sum), within bf16 rounding of the float64 gradient (tested). Written into ``out`` (a view
    of ``x``'s shape, e.g. a slice of a larger gradient buffer) if given.
    """
    grad_w = None
    if need_weight:
        grad_w = (grad * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    grad_x = None
    if need_x:
        low = x.dtype in (torch.bfloat16, torch.float16)
        grad_x = (_grad_x_layer_norm if low else _grad_x_float32)(grad, x, weight, rstd)
        if out is not None:
            grad_x = out.copy_(grad_x)
    return grad_x, grad_w


def _grad_x_layer_norm(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """The input gradient through torch's fused LayerNorm backward (bf16/fp16; one pass with
    float32 inside: 1.3-1.6 vs 2.6-3.0 ms for ``[5696, 384]`` in bf16, one thread)."""
    C = x.shape[-1]
    zero_mean = torch.zeros_like(rstd)
    grad_x: torch.Tensor = torch.ops.aten.native_layer_norm_backward(
        grad, x, [C], zero_mean, rstd, weight.float(), None, [True, False, False]
    )[0]
    # LayerNorm's gradient through its mean, -rstd * mean(g), is not RMSNorm's: add it back.
    g_sum = torch.mm(grad.reshape(-1, C), weight.unsqueeze(1)).view(rstd.shape)
    return grad_x.add_((g_sum.float() * rstd).mul_(1.0 / C).to(x.dtype))


def _grad_x_float32(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """The input gradient as ``rstd * (g - x_hat * mean(g * x_hat))`` in float32 ops."""
    g = (grad * weight).float()
    x_hat = x.float().mul_(rstd)
    dot = (g * x_hat).mean(-1, keepdim=True)
    return g.sub_(x_hat.mul_(dot)).mul_(rstd).to(x.dtype)


class RMSNormFunction(torch.autograd.Function):
    """``weight * rms_norm(x)`` over the last dim, with HF's op order and rounding.

    Forward: ``n = (x_fp32 * rstd).to(x.dtype)`` (rounded once), then ``weight * n`` in the
    input dtype, exactly as transformers' Llama/Qwen RMSNorm. Backward in float32 from the
    saved input and ``rstd``; the weight gradient is ``sum(grad * n)`` over all rows.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, n, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd, n)
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd, n = ctx.saved_tensors
        grad_x, grad_w = rms_norm_backward(
            grad,
            x,
            weight,
            n,
            rstd,
            need_x=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
        )
        return grad_x, grad_w, None


def _forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def is_hf_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an HF Llama/Qwen-style RMSNorm (see `use_fast_rms_norm`)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def use_fast_rms_norm(model: torch.nn.Module) -> int:
    """Point every HF RMSNorm module of ``model`` at `RMSNormFunction`; return how many.

    A module qualifies when its class name ends in ``RMSNorm`` and it has a 1-D ``weight``
    and a ``variance_epsilon`` (transformers' Llama, Qwen2, Qwen3 and their MoE variants).
    Only the instance's ``forward`` changes, so FSDP2 hooks and ``functional_call`` work.
    """
    count = 0
    for module in model.modules():
        if is_hf_rms_norm(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
