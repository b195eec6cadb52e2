"""Causal attention for training in bf16/fp16 on CPU: HF's "eager" maths without repeat_kv.

Why: on CPU, torch's SDPA flash kernel is fast in float32 but its bfloat16 backward is 2-3x
slower than its float32 one (measured on the `gen` benchmark shape, B=64, L=92, 6 heads of 64,
torch 2.13: 51 ms vs 21 ms per layer), which made attention 20% of a bf16 train step. Two
batched matmuls with a float32 softmax between them (HF's ``eager_attention_forward``) take
about a quarter of that. Grouped-query attention needs no copies of the keys and values: the
G query heads that share a kv head are stacked along the query axis of one matmul.

Numerics are those of HF's eager attention: scores are ``(q @ k^T) * scaling`` in the compute
dtype, softmax in float32, cast back, then ``@ v``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GQA_EAGER", "attn_implementation", "gqa_eager_attention"]

GQA_EAGER = "miles_gqa_eager"


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
    B, H, L, D = query.shape
    KV = key.shape[1]
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
    return out_BKQD.view(B, H, L, D).transpose(1, 2).contiguous(), None


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
