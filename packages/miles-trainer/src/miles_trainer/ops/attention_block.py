"""The attention block of a Llama/Qwen3 layer for training on CPU, fused.

Why: between the layer's input norm and the attention proper, HF's attention module runs
three projections, the q/k RMSNorms (Qwen3), the rotary embedding and the layout changes
(``transpose`` of q, k and v, and the copy `ops.attention` needs to stack grouped query
heads), and autograd differentiates each separately, summing three input gradients and
scattering slices. `QKVFunction` does the same maths with one ``[q; k; v]`` projection, the
norms and the rotation written out (`ops.rmsnorm`, `ops.rope`), outputs laid out as the
attention wants them, and one backward that writes the three gradients into one buffer for a
single input-gradient matmul. On the `gen` benchmark shape (one thread, AMD EPYC) a layer's
attention module, matmuls and attention included, went from 89 to 78 ms forward + backward.

Numerics: the forward is HF's bit for bit (the stacked projection gives each output column the
same bits as its own projection, tested; the norms and the rotation are HF's ops). In the
backward the input gradient is one matmul over the stacked gradients, rounded once, where
autograd rounded three matmuls and their sums: equal within bf16 rounding (tested against
float64); the other gradients are autograd's.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from miles_trainer.ops._hooks import hooked
from miles_trainer.ops.attention import GQA_EAGER, causal_attention, eager_reference
from miles_trainer.ops.rmsnorm import is_hf_rms_norm, rms_norm_backward, rms_norm_forward
from miles_trainer.ops.rope import rope_backward, rope_forward

__all__ = ["QKVFunction", "attention_core", "use_fast_attention_block", "uses_fused_attention"]


def _norm_rope(
    x_BLND: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Norm (if any) then rotation of ``[B, L, N, D]``; returns ``([B, N, L, D] contiguous,
    n, rstd)`` (``n``, ``rstd`` from the norm, None without one)."""
    n = rstd = None
    y = x_BLND
    if weight is not None:
        y, n, rstd = rms_norm_forward(x_BLND, weight, eps)
    out = rope_forward(y, cos.unsqueeze(2), sin.unsqueeze(2))
    return out.transpose(1, 2).contiguous(), n, rstd


class QKVFunction(torch.autograd.Function):
    """``x -> (q, k, v)`` of a Llama/Qwen3 attention: projections, q/k norms, RoPE, layout.

    Forward: ``qkv = x @ [wq; wk; wv]^T``; ``q = rope(q_norm(qkv_q))``, ``k =
    rope(k_norm(qkv_k))`` (no norm for Llama: weights None), ``v = qkv_v``; returned as
    ``q [B, H, L, D]``, ``k, v [B, KV, L, D]``, each contiguous. The backward writes ``dq``,
    ``dk``, ``dv`` (through the rotation and the norms) into one ``[B, L, (H + 2KV) D]``
    buffer and runs one matmul for ``dx`` and one for the three weight gradients.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        wq: torch.Tensor,
        wk: torch.Tensor,
        wv: torch.Tensor,
        q_norm_w: torch.Tensor | None,
        k_norm_w: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, C = x.shape
        D = head_dim
        H, KV = wq.shape[0] // D, wk.shape[0] // D
        x2 = x.reshape(B * L, C)
        qkv = torch.mm(x2, torch.cat([wq, wk, wv]).t()).view(B, L, (H + 2 * KV) * D)
        q_raw = qkv[..., : H * D].view(B, L, H, D)
        k_raw = qkv[..., H * D : (H + KV) * D].view(B, L, KV, D)
        q, qn, q_rstd = _norm_rope(q_raw, q_norm_w, eps, cos, sin)
        k, kn, k_rstd = _norm_rope(k_raw, k_norm_w, eps, cos, sin)
        v = qkv[..., (H + KV) * D :].view(B, L, KV, D).transpose(1, 2).contiguous()
        saved = [x2, wq, wk, wv, cos, sin, qkv]
        for t in (q_norm_w, k_norm_w, qn, q_rstd, kn, k_rstd):
            saved.append(t if t is not None else torch.empty(0))
        ctx.save_for_backward(*saved)
        ctx.dims = (B, L, C, H, KV, D)
        ctx.norms = (q_norm_w is not None, k_norm_w is not None)
        return q, k, v

    @staticmethod
    def backward(
        ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x2, wq, wk, wv, cos, sin, qkv, q_norm_w, k_norm_w, qn, q_rstd, kn, k_rstd = (
            ctx.saved_tensors
        )
        B, L, C, H, KV, D = ctx.dims
        has_qn, has_kn = ctx.norms
        dqkv = torch.empty_like(qkv)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)  # against [B, N, L, D]
        slots = (
            (dq, 0, H, has_qn, q_norm_w, qn, q_rstd, 4),
            (dk, H, KV, has_kn, k_norm_w, kn, k_rstd, 5),
        )
        norm_grads: list[torch.Tensor | None] = [None, None]
        for j, (grad, start, N, has_norm, w, n, rstd, arg) in enumerate(slots):
            slot = dqkv[..., start * D : (start + N) * D].view(B, L, N, D)
            if grad is None:
                slot.zero_()
                continue
            g_BNLD = rope_backward(grad, cos_h, sin_h)  # the rotation's input gradient
            g_BLND = g_BNLD.transpose(1, 2)
            if not has_norm:
                slot.copy_(g_BLND)
                continue
            raw = qkv[..., start * D : (start + N) * D].view(B, L, N, D)
            _, norm_grads[j] = rms_norm_backward(
                g_BLND, raw, w, n, rstd, need_weight=ctx.needs_input_grad[arg], out=slot
            )
        v_slot = dqkv[..., (H + KV) * D :].view(B, L, KV, D)
        if dv is None:
            v_slot.zero_()
        else:
            v_slot.copy_(dv.transpose(1, 2))
        dqkv2 = dqkv.view(B * L, (H + 2 * KV) * D)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(dqkv2, torch.cat([wq, wk, wv])).view(B, L, C)
        dwq = dwk = dwv = None
        if any(ctx.needs_input_grad[1:4]):
            dw = torch.mm(dqkv2.t(), x2)
            dwq, dwk, dwv = dw[: H * D], dw[H * D : (H + KV) * D], dw[(H + KV) * D :]
        return dx, dwq, dwk, dwv, norm_grads[0], norm_grads[1], None, None, None, None


def _fused_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    B, L = hidden_states.shape[:2]
    plain_mask = attention_mask is None or (
        attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and tuple(attention_mask.shape[2:]) == (L, L)
    )
    if (
        cache is not None
        or kwargs.get("past_key_values") is not None
        or not plain_mask
        or (self.training and self.attention_dropout > 0)
        or hooked(self.q_proj, self.k_proj, self.v_proj, q_norm, k_norm)
    ):
        return type(self).forward(
            self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs
        )
    cos, sin = position_embeddings
    eps = q_norm.variance_epsilon if q_norm is not None else 0.0
    q, k, v = QKVFunction.apply(
        hidden_states,
        self.q_proj.weight,
        self.k_proj.weight,
        self.v_proj.weight,
        q_norm.weight if q_norm is not None else None,
        k_norm.weight if k_norm is not None else None,
        cos,
        sin,
        eps,
        self.head_dim,
    )
    out = attention_core(self, q, k, v, attention_mask)
    return self.o_proj(out.reshape(B, L, -1)), None


def attention_core(
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The model's attention over ``q [B, H, L, D]``, ``k, v [B, KV, L, D]`` (causal, or a
    boolean keep-mask): the trainer's GQA eager attention, or HF's SDPA call (float32) as
    HF makes it; ``[B, L, H, D]`` contiguous."""
    if module.config._attn_implementation == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out: torch.Tensor = sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)[0]
        return out
    fast = causal_attention(q, k, v, mask, module.scaling)
    if fast is None:  # a per-sample boolean mask
        return eager_reference(q, k, v, mask, module.scaling)
    return fast


def _supported(module: torch.nn.Module) -> bool:
    """A Llama/Qwen3-style attention: bias-free q/k/v/o ``Linear``s, full attention, and q/k
    norms that are HF RMSNorms of one shared epsilon (or none, as in Llama)."""
    projs = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(type(p) is torch.nn.Linear and p.bias is None for p in projs):
        return False
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or not isinstance(getattr(module, "scaling", None), float):
        return False
    if getattr(module, "sliding_window", None) is not None:
        return False
    norms = [getattr(module, "q_norm", None), getattr(module, "k_norm", None)]
    if any(n is not None for n in norms):
        if not all(n is not None and is_hf_rms_norm(n) for n in norms):
            return False
        if norms[0].variance_epsilon != norms[1].variance_epsilon:  # type: ignore[union-attr]
            return False
    return True


def uses_fused_attention(module: torch.nn.Module) -> bool:
    """Whether `use_fast_attention_block` routed ``module`` through the fused forward."""
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, types.MethodType) and fwd.__func__ is _fused_forward


def use_fast_attention_block(model: torch.nn.Module) -> int:
    """Route every supported attention module of ``model`` through `QKVFunction` and
    `attention_core`; return how many.

    Only modules whose class name ends in ``Attention`` with bias-free ``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj`` (transformers' Llama, Qwen3, Qwen3-MoE) and full (not sliding)
    attention are changed, and only when the model attends with the trainer's GQA eager
    attention (bf16/fp16 on CPU) or HF's SDPA (float32). At run time a KV cache, an additive
    mask, dropout or forward hooks on the projections send a call to HF's own forward.
    """
    count = 0
    for module in model.modules():
        attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if (
            type(module).__name__.endswith("Attention")
            and attn in (GQA_EAGER, "sdpa")
            and _supported(module)
        ):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count
