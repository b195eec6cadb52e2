"""Mixture-of-experts layers (Qwen3-MoE) for the engine's runner, and their checkpoint names.

The maths is transformers' ``Qwen3MoeSparseMoeBlock``: router logits ``h @ W_r^T`` in the
model dtype, softmax in float32, top-k (sorted, ``torch.topk``), optional renormalisation of
the k weights, cast back; then every expert that received tokens runs its SwiGLU on them, the
output is scaled by the token's weight for that expert and added into the result, experts in
ascending order (``index_add_``), as transformers does. Each token's top-k expert ids are
returned for R3 (rollout routing replay).

transformers keeps the experts of a layer fused (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``) while checkpoints (and SGLang, and trainers) name them per
expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``); :func:`expert_aliases` maps the
checkpoint names onto views of the fused tensors, so weight updates and checksums accept both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MoeWeights", "expert_aliases", "is_moe_layer", "moe_forward"]

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def is_moe_layer(mlp: Any) -> bool:
    """Whether an HF decoder layer's ``mlp`` is a sparse MoE block."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class MoeWeights:
    """The tensors of one MoE block (views of the HF parameters, so updates are seen)."""

    __slots__ = ("down", "gate_up", "norm_topk", "router", "top_k")

    def __init__(self, mlp: Any, served: Callable[[torch.Tensor], torch.Tensor] = _same) -> None:
        experts = mlp.experts
        if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
            raise ValueError(
                "this MoE checkpoint's experts are not transformers' fused Qwen3-MoE layout "
                "(mlp.experts.gate_up_proj / down_proj); serve it with SGLang"
            )
        self.router: torch.Tensor = mlp.gate.weight  # [E, H]
        # `served`: the tensor computed with (a dequantized copy under a low-precision format).
        self.gate_up: torch.Tensor = served(experts.gate_up_proj)  # [E, 2I, H]
        self.down: torch.Tensor = served(experts.down_proj)  # [E, H, I]
        self.top_k: int = int(mlp.gate.top_k)
        self.norm_topk: bool = bool(mlp.gate.norm_topk_prob)


def moe_forward(
    h_NH: torch.Tensor, w: MoeWeights, linear: Linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE block on normalised hidden states; returns ``(out [N, H], experts [N, k])``.

    ``linear(x, weight, bias)`` is the runner's GEMM (row-padded when it is batch
    invariant, so a token's bits do not depend on which other tokens share its experts).
    """
    logits_NE = linear(h_NH, w.router, None)
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    top_v_NK, top_i_NK = torch.topk(probs_NE, w.top_k, dim=-1)
    if w.norm_topk:
        top_v_NK = top_v_NK / top_v_NK.sum(dim=-1, keepdim=True)
    top_v_NK = top_v_NK.to(logits_NE.dtype)
    out_NH = torch.zeros_like(h_NH)
    for e in torch.unique(top_i_NK).tolist():  # ascending, as transformers' expert loop
        tok, slot = torch.where(top_i_NK == e)
        gate, up = linear(h_NH[tok], w.gate_up[e], None).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w.down[e], None)
        out_NH.index_add_(0, tok, y * top_v_NK[tok, slot, None])
    return out_NH, top_i_NK.to(torch.int32)


def expert_aliases(model: Any) -> dict[str, torch.Tensor]:
    """Checkpoint (per-expert) names -> views of transformers' fused expert tensors."""
    out: dict[str, torch.Tensor] = {}
    inner = getattr(model, "model", None)
    for li, layer in enumerate(getattr(inner, "layers", [])):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not is_moe_layer(mlp):
            continue
        experts = mlp.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        inter = gate_up.shape[1] // 2
        prefix = f"model.layers.{li}.mlp.experts"
        for e in range(gate_up.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{prefix}.{e}.down_proj.weight"] = down[e]
    return out
