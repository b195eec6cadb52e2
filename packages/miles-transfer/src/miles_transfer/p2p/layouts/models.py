"""The Qwen3 / Qwen3-MoE parameter set in HF names, and generic layouts (replicated, split).

`ModelShape` holds the handful of config numbers the layouts need; `ModelShape.from_hf_config`
reads them from a transformers `Qwen3Config` / `Qwen3MoeConfig` (duck-typed: transformers is not
a dependency). `replicated_layout` (every rank holds every parameter whole) and `split_layout`
(any model, each parameter split along one dimension) describe engines of any model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles_transfer.p2p.layouts.base import Layout, LocalTensor, ParamSpec, Piece, make_layout

__all__ = ["ModelShape", "qwen3_params", "replicated_layout", "split_layout", "whole"]


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelShape:
    """The numbers that fix a Qwen3(-MoE) model's parameter shapes.

    Attributes:
        hidden: hidden size H.
        intermediate: dense MLP intermediate size (unused when num_experts > 0).
        num_layers: decoder layers.
        num_heads: query heads; num_kv_heads: key/value heads (GQA groups).
        head_dim: per-head size D.
        vocab: vocabulary size V.
        num_experts: routed experts per layer (0: dense model).
        moe_intermediate: intermediate size of one expert.
        tie_word_embeddings: lm_head shares embed_tokens (no lm_head.weight).
        dtype: parameter dtype on both sides of the transfer.
    """

    hidden: int
    intermediate: int = 0
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int = 0
    moe_intermediate: int = 0
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for f in ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelShape.{f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.num_experts > 0 and self.moe_intermediate <= 0:
            raise ValueError("an MoE ModelShape (num_experts > 0) needs moe_intermediate > 0")
        if self.num_experts == 0 and self.intermediate <= 0:
            raise ValueError("a dense ModelShape needs intermediate > 0")

    @classmethod
    def from_hf_config(cls, config: Any, *, dtype: torch.dtype = torch.bfloat16) -> ModelShape:
        """Read a transformers Qwen3Config or Qwen3MoeConfig (any object with those fields)."""
        heads = int(config.num_attention_heads)
        return cls(
            hidden=int(config.hidden_size),
            intermediate=int(getattr(config, "intermediate_size", 0) or 0),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            vocab=int(config.vocab_size),
            num_experts=int(getattr(config, "num_experts", 0) or 0),
            moe_intermediate=int(getattr(config, "moe_intermediate_size", 0) or 0),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            dtype=dtype,
        )


def qwen3_params(m: ModelShape) -> dict[str, ParamSpec]:
    """Every parameter of a Qwen3 (or Qwen3-MoE, all layers sparse) model, in HF names."""
    H, D, dt = m.hidden, m.head_dim, m.dtype
    out: dict[str, ParamSpec] = {"model.embed_tokens.weight": ParamSpec((m.vocab, H), dt)}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ParamSpec((H,), dt)
        out[p + "self_attn.q_proj.weight"] = ParamSpec((m.num_heads * D, H), dt)
        out[p + "self_attn.k_proj.weight"] = ParamSpec((m.num_kv_heads * D, H), dt)
        out[p + "self_attn.v_proj.weight"] = ParamSpec((m.num_kv_heads * D, H), dt)
        out[p + "self_attn.o_proj.weight"] = ParamSpec((H, m.num_heads * D), dt)
        out[p + "self_attn.q_norm.weight"] = ParamSpec((D,), dt)
        out[p + "self_attn.k_norm.weight"] = ParamSpec((D,), dt)
        out[p + "post_attention_layernorm.weight"] = ParamSpec((H,), dt)
        if m.num_experts:
            out[p + "mlp.gate.weight"] = ParamSpec((m.num_experts, H), dt)
            inter = m.moe_intermediate
            for e in range(m.num_experts):
                q = f"{p}mlp.experts.{e}."
                out[q + "gate_proj.weight"] = ParamSpec((inter, H), dt)
                out[q + "up_proj.weight"] = ParamSpec((inter, H), dt)
                out[q + "down_proj.weight"] = ParamSpec((H, inter), dt)
        else:
            out[p + "mlp.gate_proj.weight"] = ParamSpec((m.intermediate, H), dt)
            out[p + "mlp.up_proj.weight"] = ParamSpec((m.intermediate, H), dt)
            out[p + "mlp.down_proj.weight"] = ParamSpec((H, m.intermediate), dt)
    out["model.norm.weight"] = ParamSpec((H,), dt)
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = ParamSpec((m.vocab, H), dt)
    return out


def whole(name: str, spec: ParamSpec) -> LocalTensor:
    """A local tensor holding the whole parameter."""
    zeros = (0,) * len(spec.shape)
    return LocalTensor(spec.shape, spec.dtype, (Piece(name, zeros, spec.shape, zeros),))


def replicated_layout(params: Mapping[str, ParamSpec], world_size: int = 1) -> Layout:
    """Every rank holds every parameter whole under its HF name (TP 1 engines, DDP trainers)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rank = {name: whole(name, spec) for name, spec in params.items()}
    return make_layout(f"replicated(ws={world_size})", params, [rank] * world_size)


def split_layout(
    params: Mapping[str, ParamSpec], tp: int, dims: Mapping[str, int | None], *, dp: int = 1
) -> Layout:
    """Any model's tensor-parallel layout: each parameter split evenly along one dimension.

    Args:
        params: HF name -> ParamSpec.
        tp: ranks per replica; rank `r * tp + t` of `dp` replicas holds slice t.
        dims: HF name -> the dimension split over TP (0: column parallel for a Linear weight,
            1: row parallel), or None to replicate; names not listed are replicated. Local
            tensor names are the HF names.

    Raises:
        ValueError: a split dimension is not divisible by tp, or dims names an unknown parameter.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    unknown = sorted(set(dims) - set(params))
    if unknown:
        raise ValueError(f"split_layout: dims names parameters the model does not have: {unknown}")
    ranks: list[dict[str, LocalTensor]] = []
    for _ in range(dp):
        for t in range(tp):
            r: dict[str, LocalTensor] = {}
            for name, spec in params.items():
                d = dims.get(name)
                if d is None:
                    r[name] = whole(name, spec)
                    continue
                if not 0 <= d < len(spec.shape) or spec.shape[d] % tp:
                    raise ValueError(
                        f"split_layout: {name!r} of shape {spec.shape} cannot be split evenly "
                        f"along dim {d} over {tp} ranks"
                    )
                n = spec.shape[d] // tp
                start = tuple(t * n if k == d else 0 for k in range(len(spec.shape)))
                size = tuple(n if k == d else s for k, s in enumerate(spec.shape))
                zeros = (0,) * len(spec.shape)
                r[name] = LocalTensor(size, spec.dtype, (Piece(name, start, size, zeros),))
            ranks.append(r)
    return make_layout(f"split(tp={tp},dp={dp})", params, ranks)
