"""Rotary position embedding as transformers applies it, in fewer passes, and its gradient.

HF's ``apply_rotary_pos_emb`` computes ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``: five elementwise ops and a ``cat``, each a pass over the
activations (and autograd's backward through each). With ``x = [x1, x2]`` and ``s = [s1, s2]``
the same bits come from ``t = x * cos`` and two half-width products: ``out1 = t1 - x2 * s1``
and ``out2 = t2 + x1 * s2`` (``(-a) * b == -(a * b)`` and ``t + (-p) == t - p`` exactly in
IEEE arithmetic, so every element is rounded as HF rounds it). The backward is the transposed
rotation, ``dx1 = g1 * c1 + g2 * s2`` and ``dx2 = g2 * c2 - g1 * s1`` with ``g * cos`` and
``g * sin`` each rounded once, as autograd rounds them.
"""

from __future__ import annotations

import torch

__all__ = ["rope_backward", "rope_forward"]


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the last dim, HF's bits (a new tensor).

    Args:
        x: ``[..., D]`` with even ``D``.
        cos: broadcastable to ``x``.
        sin: broadcastable to ``x``.
    """
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h].sub_(x[..., h:] * sin[..., :h])
    out[..., h:].add_(x[..., :h] * sin[..., h:])
    return out


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of `rope_forward` with respect to ``x`` (a new tensor, ``grad``'s shape)."""
    h = grad.shape[-1] // 2
    out = grad * cos
    gs = grad * sin
    out[..., :h].add_(gs[..., h:])
    out[..., h:].sub_(gs[..., :h])
    return out
