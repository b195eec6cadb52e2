"""Causal attention for training in bf16/fp16 on CPU: HF's "eager" maths without repeat_kv.

Why: on CPU, torch's SDPA flash kernel is fast in float32 but its bfloat16 backward is 2-3x
slower than its float32 one (measured on the `gen` benchmark shape, B=64, L=92, 6 heads of 64,
torch 2.13: 51 ms vs 21 ms per layer), which made attention 20% of a bf16 train step. Two
batched matmuls with a float32 softmax between them (HF's ``eager_attention_forward``) take
about a quarter of that. Grouped-query attention needs no copies of the keys and values: the
G query heads that share a kv head are stacked along the query axis of one matmul.

Numerics are those of HF's eager attention: scores are ``(q @ k^T) * scaling`` in the compute
dtype, masked, softmax in float32, cast back, then ``@ v``. `CausalAttentionFunction` computes
exactly that with a backward written out (the same bits as autograd through those ops, tested):
autograd's graph also differentiated the scaling and the mask (two more passes over the
``B x H x L x L`` scores, where the softmax's backward already gives zeros), copied the scores'
gradient for the scaling and saved more than it needed; written out, one layer's attention
forward + backward of the `gen` shape took 26 instead of 36 ms (one thread, AMD EPYC).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["GQA_EAGER", "CausalAttentionFunction", "attn_implementation", "gqa_eager_attention"]

GQA_EAGER = "miles_gqa_eager"


@functools.lru_cache(maxsize=16)
def _causal_bias(L: int, G: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[G * L, L]``: 0 where query row ``i % L`` may see key ``j`` (j <= i % L), else -inf."""
    future = torch.ones(L, L, dtype=torch.bool, device=device).triu_(1)
    bias = torch.zeros(L, L, dtype=dtype, device=device).masked_fill_(future, float("-inf"))
    return bias.repeat(G, 1)


def _bias_from_mask(keep_11LL: torch.Tensor, G: int, dtype: torch.dtype) -> torch.Tensor:
    """``[G * L, L]`` additive bias from a boolean keep-mask ``[1, 1, L, L]`` (True: attend)."""
    bias = torch.zeros(keep_11LL.shape[-2:], dtype=dtype, device=keep_11LL.device)
    return bias.masked_fill_(~keep_11LL[0, 0], float("-inf")).repeat(G, 1)


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _scaled_bmm(a: torch.Tensor, b: torch.Tensor, scaling: float, exact: bool) -> torch.Tensor:
    """``(a @ b)`` scaled as HF does: ``round(a @ b) * scaling`` (exact=True: a power of two,
    folded into the matmul's output scale, which is the same bits) or ``a.mul(scaling) @ b``
    in the backward (exact=False: the scaled operand rounded first, as autograd does)."""
    if exact:
        out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
        return torch.baddbmm(out, a, b, beta=0.0, alpha=scaling)
    return torch.bmm(a * scaling, b)


class CausalAttentionFunction(torch.autograd.Function):
    """HF eager attention (GQA stacked) with a causal or given additive bias, written out.

    Forward, with ``q [B, H, L, D]`` and ``k, v [B, KV, L, D]``, ``G = H // KV``:
    ``s = round(q @ k^T) * scaling + bias`` in the compute dtype (``bias`` is 0 or -inf),
    ``p32 = softmax(float32(s))``, ``p = p32.to(dtype)``, ``out = p @ v``; returned as
    ``[B, L, H, D]`` contiguous (HF's attention-function layout). The backward is autograd's
    of those ops: ``dp = dout @ v^T``, ``dv = p^T @ dout``,
    ``ds = softmax_backward(float32(dp), p32).to(dtype)`` (zero where the bias is -inf, as
    the mask's own backward would make it), ``dq = (ds * scaling) @ k``,
    ``dk = (ds * scaling)^T @ q``. A power-of-two ``scaling`` (``head_dim`` 4, 16, 64, 256)
    is folded into the matmuls (exact: the same bits); others are applied as HF does.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias_QL: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        B, H, L, D = q.shape
        KV = k.shape[1]
        G = H // KV
        q3 = q.reshape(B * KV, G * L, D)  # head h -> kv head h // G (HF's repeat_kv)
        k3 = k.reshape(B * KV, L, D)
        v3 = v.reshape(B * KV, L, D)
        bias = bias_QL.expand(B * KV, G * L, L)
        exact = _power_of_two(scaling)
        if exact:  # one pass: round(q @ k^T) * 2^n + bias == round(2^n * (q @ k^T) + bias)
            s = torch.baddbmm(bias, q3, k3.transpose(1, 2), beta=1.0, alpha=scaling)
        else:
            s = torch.bmm(q3, k3.transpose(1, 2)).mul_(scaling).add_(bias)
        p32 = torch.softmax(s, dim=-1, dtype=torch.float32)
        del s
        p = p32.to(q.dtype)
        out = torch.bmm(p, v3)
        ctx.save_for_backward(q3, k3, v3, p32, p)
        ctx.dims = (B, H, KV, G, L, D)
        ctx.scaling = scaling
        ctx.exact = exact
        return out.view(B, H, L, D).transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q3, k3, v3, p32, p = ctx.saved_tensors
        B, H, KV, G, L, D = ctx.dims
        dout3 = dout.transpose(1, 2).reshape(B * KV, G * L, D)  # [B, L, H, D] -> stacked
        dv = torch.bmm(p.transpose(1, 2), dout3) if ctx.needs_input_grad[2] else None
        dp = torch.bmm(dout3, v3.transpose(1, 2))
        ds = torch._softmax_backward_data(dp.float(), p32, -1, torch.float32).to(dp.dtype)
        del dp
        dq = dk = None
        if ctx.needs_input_grad[0]:
            dq = _scaled_bmm(ds, k3, ctx.scaling, ctx.exact).view(B, H, L, D)
        if ctx.needs_input_grad[1]:
            dk = _scaled_bmm(ds.transpose(1, 2), q3, ctx.scaling, ctx.exact).view(B, KV, L, D)
        if dv is not None:
            dv = dv.view(B, KV, L, D)
        return dq, dk, dv, None, None


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor | None:
    """`CausalAttentionFunction` for a plain causal batch (mask None) or a boolean keep-mask
    ``[1, 1, L, L]`` (one packed row); None for anything else (the caller falls back)."""
    H, L = query.shape[1:3]
    KV = key.shape[1]
    if key.shape[2] != L or H % KV:
        return None
    G = H // KV
    if attention_mask is None:
        bias = _causal_bias(L, G, query.dtype, query.device)
    elif (
        attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and tuple(attention_mask.shape) == (1, 1, L, L)
    ):
        bias = _bias_from_mask(attention_mask, G, query.dtype)
    else:
        return None
    out: torch.Tensor = CausalAttentionFunction.apply(query, key, value, bias, scaling)
    return out


def gqa_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal self-attention over a whole sequence, in HF's attention-function signature.

    Args:
        module: the HF attention module (unused; HF passes it).
        query: ``[B, H, L, D]``.
        key: ``[B, KV, L, D]`` with ``H % KV == 0``.
        value: ``[B, KV, L, D]``.
        attention_mask: None (right-padded batches: causality keeps padding out of every
            real position) or a boolean ``[B or 1, 1, L, L]`` mask, True where a query may
            attend (packed batches: transformers builds the block-diagonal causal mask from
            the restarting ``position_ids``, see `attn_implementation`). Anything else (an
            additive mask, a KV cache, dropout) is handed to HF's SDPA path unchanged.
        scaling: the softmax scale.
        dropout: dropout probability (only honoured through the SDPA fallback).

    Returns:
        ``(out [B, L, H, D] contiguous, None)``.
    """
    L = query.shape[2]
    bool_mask = (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and tuple(attention_mask.shape[1:]) == (1, L, L)
    )
    plain = attention_mask is None or bool_mask
    if not plain or key.shape[2] != L or (dropout > 0 and module.training):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    fast = causal_attention(query, key, value, attention_mask, scaling)
    if fast is not None:
        return fast, None
    return eager_reference(query, key, value, attention_mask, scaling), None


def eager_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """HF's eager maths through autograd (GQA stacked, in-place scale and mask): the reference
    `CausalAttentionFunction` is tested against, and the path for per-sample boolean masks."""
    B, H, L, D = query.shape
    KV = key.shape[1]
    G = H // KV
    # Head h uses kv head h // G (HF's repeat_kv), so [B, H, L, D] -> [B, KV, G * L, D].
    q_BKQD = query.reshape(B, KV, G * L, D)
    scores = torch.matmul(q_BKQD, key.transpose(2, 3))  # [B, KV, G * L, L]
    # In place (the same bits as ``* scaling`` and ``masked_fill``): neither op's backward
    # needs the scores, and each out-of-place copy was a full pass over B x H x L x L.
    scores.mul_(scaling)
    if attention_mask is None:
        hidden = torch.ones(L, L, dtype=torch.bool, device=query.device).triu_(1)
    else:
        hidden = ~attention_mask.unsqueeze(2)  # [B, 1, 1, L, L] against [B, KV, G, L, L]
    scores = scores.view(B, KV, G, L, L).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out_BKQD = torch.matmul(probs.view(B, KV, G * L, L), value)
    return out_BKQD.view(B, H, L, D).transpose(1, 2).contiguous()


def attn_implementation(dtype: torch.dtype, device: torch.device) -> str:
    """The HF ``attn_implementation`` the trainer uses for this compute dtype and device.

    float32 (any device) and CUDA keep HF's default SDPA; bf16/fp16 on CPU use
    `gqa_eager_attention` (registered with transformers on first use).
    """
    if dtype == torch.float32 or device.type != "cpu":
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_EAGER, gqa_eager_attention)
    # Without a mask function transformers builds no mask for a custom attention, and a packed
    # row (sequence packing) would attend across its samples. SDPA's mask is None for a plain
    # causal batch (the fast path above) and the boolean block-diagonal mask for a packed one.
    AttentionMaskInterface.register(GQA_EAGER, sdpa_mask)
    return GQA_EAGER
