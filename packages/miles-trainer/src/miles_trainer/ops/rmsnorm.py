"""RMSNorm for low-precision training on CPU: transformers' forward bits, a shorter backward.

Why: HF's RMSNorm (``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)``) is about
eight elementwise ops, and autograd differentiates each one, keeping float32 copies of the
activations. In a bf16 train step on CPU, where the GEMMs are fast, the 25 norms of the `gen`
benchmark model (4 per layer: input, post-attention, q and k) took about a third of the step
(28 ms forward + backward per ``[5696, 384]`` norm, one thread). Here the forward is torch's
fused ``rms_norm`` kernel (the same bits as HF's, checked by the tests) and the backward is
written out in float32 (``dx = rstd * (g - x_hat * mean(g * x_hat))``): 18 ms for the same norm.

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

    ``grad_weight = sum(grad * n)`` over all rows (in the weight's dtype, as autograd's);
    ``grad_x = rstd * (g - x_hat * mean(g * x_hat))`` in float32 with ``g = grad * weight``
    and ``x_hat = x * rstd``, cast to the input dtype (written into ``out`` if given: a view
    of ``x``'s shape, e.g. a slice of a larger gradient buffer; the same rounding).
    """
    grad_w = None
    if need_weight:
        grad_w = (grad * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    grad_x = None
    if need_x:
        g = (grad * weight).float()
        x_hat = x.float().mul_(rstd)
        dot = (g * x_hat).mean(-1, keepdim=True)
        g.sub_(x_hat.mul_(dot)).mul_(rstd)
        grad_x = g.to(x.dtype) if out is None else out.copy_(g)
    return grad_x, grad_w


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
