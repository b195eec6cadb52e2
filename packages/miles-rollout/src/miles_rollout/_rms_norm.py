"""bf16 RMSNorm for the engine: the native kernel and the PyTorch reference.

The reference is transformers' RMSNorm as the engine computes it (``_model._rms``): normalise in
float32, round to the compute dtype, multiply by the weight in that dtype. In bf16 PyTorch runs
it as about eight small ops; ``miles_rollout._ext.rms_norm`` does one pass per row with the same
float operations in the same order (including PyTorch's summation order of the squares, see
``native/rollout/src/rms_norm.cpp``), so the outputs are identical bit for bit. That order is a
property of this PyTorch build, so the engine checks it per row size on random rows before it
uses the kernel (``native_rms_norm_is_exact``) and keeps PyTorch's ops otherwise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from miles_rollout import _native

__all__ = ["native_rms_norm", "native_rms_norm_is_exact", "torch_rms_norm"]


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm bits in PyTorch ops (``w`` broadcast against ``x``)."""
    # torch's fused rms_norm gives those bits: in float32 with the weight fused, in bf16/fp16
    # without it (it normalises in float32 and rounds once; the weight product must then be
    # a separate low-precision multiply, as in transformers).
    if x.dtype == torch.float32 and w.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x, (x.shape[-1],), None, eps)


def native_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The kernel's RMSNorm of bf16 ``x [..., D]`` by ``w [D]`` (or ``[H, D]`` for ``[.., H, D]``).

    Returns a new contiguous tensor of ``x``'s shape, or None when the kernel does not take
    these operands (not bf16, ``D`` not a multiple of 16, a layout it cannot stride over, or no
    extension); the caller then uses :func:`torch_rms_norm`.
    """
    ext = _native.ext
    d = x.shape[-1]
    if ext is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or d % 16:
        return None
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        return None
    v = x
    if v.dim() == 4 and v.stride(0) == v.shape[1] * v.stride(1):
        v = v.flatten(0, 1)
    if v.dim() == 2:
        a, b, sa, sb = v.shape[0], 1, v.stride(0), 0
    elif v.dim() == 3:
        a, b, sa, sb = v.shape[0], v.shape[1], v.stride(0), v.stride(1)
    else:
        return None
    if w.dim() == 1 and w.shape[0] == d:
        ws = 0
    elif w.dim() == 2 and tuple(w.shape) == (b, d):
        ws = w.stride(0)
    else:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    ext.rms_norm(v.data_ptr(), a, b, d, sa, sb, w.data_ptr(), ws, eps, out.data_ptr())
    return out


@functools.cache
def native_rms_norm_is_exact(d: int, eps: float) -> bool:
    """Whether the kernel gives PyTorch's bits for rows of ``d`` (random rows, several scales)."""
    if _native.ext is None or d % 16:
        return False
    gen = torch.Generator().manual_seed(d)
    scale = torch.logspace(-3, 3, 64)[:, None]
    x = (torch.randn(64, d, generator=gen) * scale).bfloat16()
    w = torch.randn(d, generator=gen).bfloat16()
    got = native_rms_norm(x, w, eps)
    return got is not None and torch.equal(
        got.view(torch.int16), torch_rms_norm(x, w, eps).view(torch.int16)
    )
