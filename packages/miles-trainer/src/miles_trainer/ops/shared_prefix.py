"""Compute a prefix that several rows of a batch share once (GRPO: n samples of one prompt).

Why: an RL batch holds ``n`` samples per prompt, each row the prompt followed by its own
response, so every prompt token is run through every layer ``n`` times with the same result
(causal attention: a token's hidden state depends only on the tokens before it). In the
`gen` benchmark (8 prompts x 8 samples, ~25 prompt + 64 response tokens) that is 28% of the
batch's tokens, 7/8 of them repeats. `use_shared_prefix` makes the decoder stack (HF's
``LlamaModel`` / ``Qwen3Model``) run its token-wise work (norms, projections, MLPs, residual
adds) once per distinct token-with-its-prefix, and only the attention on the rows as they
are, gathering queries, keys and values from the distinct tokens. The token-wise matmuls of
`gen` shrink from 5696 to about 4300 rows.

Two tokens are the same when their rows agree on every token up to and including them
(`plan_shared_prefix`; rows at positions ``0..L-1``, the padded layout); this also merges rows
that repeat a whole sequence or begin their responses alike.

Numerics: the forward is the padded forward's bit for bit (a matmul's row does not depend on
the other rows, checked by the tests; the attention sees the same rows). In the backward,
the gradients of a shared token's copies are summed in float32 and rounded once, where the
padded layout kept one rounded gradient per copy until the weight-gradient matmuls summed
them: within bf16 rounding (tested against float64).

Runs only where the trainer's fused attention blocks (`ops.attention_block`) are installed
on every layer, the MLPs are dense, no module has hooks (FSDP2's several-rank wrapping, QAT)
and the call is a plain forward (``input_ids``, no mask, no cache, nothing else asked for);
anything else takes HF's forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from miles_trainer.ops._hooks import hooked
from miles_trainer.ops.attention_block import QKVFunction, attention_core, uses_fused_attention

__all__ = ["plan_shared_prefix", "use_shared_prefix"]

# Below this share of distinct tokens the gathers cost less than the repeated work saves.
_MAX_DISTINCT_SHARE = 0.95


def plan_shared_prefix(input_ids_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens of a batch whose rows share their positions (``0..L-1``), where a
    token is its row's prefix up to and including it.

    Rows are sorted lexicographically; each row then shares its first ``lcp`` tokens with the
    row before it (their longest common prefix) and brings new ones after: rows that agree up
    to a token are contiguous in that order, so this finds every repeat with one vector
    comparison per row.

    Returns:
        ``(owner_T, index_BL)``: for each distinct token, the flat index (``row * L + col``)
        of its first occurrence in row-major order (ascending); for each position, the index
        of its distinct token.
    """
    B, L = input_ids_BL.shape
    ids = input_ids_BL.to(torch.int64)
    rows = sorted(range(B), key=ids.tolist().__getitem__)
    gid_BL = torch.empty(B, L, dtype=torch.int64)
    next_id, prev = 0, -1
    for r in rows:
        lcp = 0
        if prev >= 0:
            diff = (ids[r] != ids[prev]).nonzero()
            lcp = int(diff[0]) if diff.numel() else L
            gid_BL[r, :lcp] = gid_BL[prev, :lcp]
        gid_BL[r, lcp:] = torch.arange(next_id, next_id + L - lcp)
        next_id += L - lcp
        prev = r
    flat = torch.arange(B * L, dtype=torch.int64)
    first = torch.full((next_id,), B * L, dtype=torch.int64)
    first.scatter_reduce_(0, gid_BL.view(-1), flat, reduce="amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(next_id, dtype=torch.int64)
    return first[order], rank[gid_BL]


class _GatherRows(torch.autograd.Function):
    """``src[index]`` along dim 0, whose backward sums the copies' gradients in float32."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = src.shape[0]
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        acc = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32)
        acc.index_add_(0, index, grad.float())
        return acc.to(grad.dtype), None


def _to_rows(t_1NTD: torch.Tensor, index_BL: torch.Tensor) -> torch.Tensor:
    """``[1, N, T, D]`` distinct tokens -> ``[B, N, L, D]`` rows."""
    B, L = index_BL.shape
    N, D = t_1NTD.shape[1], t_1NTD.shape[3]
    rows = _GatherRows.apply(t_1NTD[0].transpose(0, 1), index_BL.view(-1))  # [B * L, N, D]
    return rows.view(B, L, N, D).transpose(1, 2)


def _layer(
    layer: Any,
    h_1TC: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    owner_T: torch.Tensor,
    index_BL: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer (HF's Llama/Qwen3 order) on the distinct tokens."""
    attn = layer.self_attn
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    x = layer.input_layernorm(h_1TC)
    q, k, v = QKVFunction.apply(
        x,
        attn.q_proj.weight,
        attn.k_proj.weight,
        attn.v_proj.weight,
        q_norm.weight if q_norm is not None else None,
        k_norm.weight if k_norm is not None else None,
        cos,
        sin,
        q_norm.variance_epsilon if q_norm is not None else 0.0,
        attn.head_dim,
    )
    q, k, v = (_to_rows(t, index_BL) for t in (q, k, v))
    out = attention_core(attn, q, k, v, None)
    B, L, H, D = out.shape
    # Every copy of a token attends the same prefix: keep its first occurrence's output.
    out_TC = out.reshape(B * L, H * D).index_select(0, owner_T)
    h_1TC = h_1TC + attn.o_proj(out_TC)[None]
    return h_1TC + layer.mlp(layer.post_attention_layernorm(h_1TC))


def _eligible(self: Any, kwargs: dict[str, Any]) -> bool:
    if any(v not in (None, False) for v in kwargs.values()):
        return False  # outputs asked for (hidden states, attentions), a cache, ...
    if getattr(self, "gradient_checkpointing", False) and self.training:
        return False
    layers = list(self.layers[: self.config.num_hidden_layers])
    return (
        all(uses_fused_attention(layer.self_attn) for layer in layers)
        and all(type(layer.mlp).__name__.endswith("MLP") for layer in layers)
        and not hooked(*self.modules())
    )


def _forward(
    self: Any,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> Any:
    def hf() -> Any:
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

    if (
        input_ids is None
        or inputs_embeds is not None
        or attention_mask is not None
        or use_cache is not False
        or input_ids.dim() != 2
        or not _eligible(self, kwargs)
    ):
        return hf()
    B, L = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
    elif position_ids.shape[-1] != L or not bool(
        (position_ids == torch.arange(L, device=position_ids.device)).all()
    ):
        return hf()  # packed rows (positions restart) or other positions: HF's forward
    owner_T, index_BL = plan_shared_prefix(input_ids.cpu())
    if owner_T.numel() > _MAX_DISTINCT_SHARE * B * L:
        return hf()
    owner_T, index_BL = owner_T.to(input_ids.device), index_BL.to(input_ids.device)
    ids_1T = input_ids.reshape(-1)[owner_T][None]
    pos_1T = position_ids.expand(B, L).reshape(-1)[owner_T][None]
    h = self.embed_tokens(ids_1T)
    cos, sin = self.rotary_emb(h, pos_1T)
    for layer in self.layers[: self.config.num_hidden_layers]:
        h = _layer(layer, h, cos, sin, owner_T, index_BL)
    h = self.norm(h)
    from transformers.modeling_outputs import BaseModelOutputWithPast

    hidden = _GatherRows.apply(h[0], index_BL.view(-1)).view(B, L, -1)
    return BaseModelOutputWithPast(last_hidden_state=hidden)


def use_shared_prefix(model: torch.nn.Module) -> int:
    """Give every HF Llama/Qwen3 decoder stack in ``model`` (a causal LM's ``model``, a
    critic's backbone) the shared-prefix forward; return how many.

    Install it after `ops.attention_block.use_fast_attention_block`; at each call it checks
    that every layer still uses the fused attention and that nothing else is asked for.
    """
    count = 0
    for module in model.modules():
        if all(hasattr(module, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
