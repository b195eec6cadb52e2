"""Fused MoE expert parameters -> the per-expert tensors engines load.

transformers 5 keeps the experts of Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE and related models
fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H] with the gate rows first, and
``mlp.experts.down_proj`` [E, H, I]); ``save_pretrained`` converts them back to per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``, and SGLang / vLLM load those names. A
checkpoint written from the state dict (a trainer's) holds the fused names; the exporter splits
them so that the quantized checkpoint has the names engines load. gpt-oss keeps its fused
experts (its loaders read them fused).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SPLIT_MODEL_TYPES", "split_experts", "split_names", "splits"]

# Model types whose transformers conversion is the Qwen2-MoE one (per-expert gate/up/down).
SPLIT_MODEL_TYPES = (
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_omni_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe",
    "glm4_moe_lite",
    "glm4v_moe",
    "dots1",
    "ernie4_5_moe",
    "olmoe",
    "flex_olmo",
    "hunyuan_v1_moe",
)
_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def splits(cfg: dict[str, Any], name: str, ndim: int) -> bool:
    """Whether the tensor ``name`` is a fused expert parameter to write per expert."""
    return cfg.get("model_type") in SPLIT_MODEL_TYPES and ndim == 3 and name.endswith(_SUFFIXES)


def split_names(name: str, shape: list[int]) -> list[str]:
    """The per-expert tensor names a fused parameter of ``shape`` becomes, in write order."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "down_proj":
        return [f"{prefix}.{e}.down_proj.weight" for e in range(shape[0])]
    return [f"{prefix}.{e}.{p}_proj.weight" for e in range(shape[0]) for p in ("gate", "up")]


def split_experts(name: str, t: torch.Tensor) -> list[list[tuple[str, torch.Tensor]]]:
    """Per-expert pieces of a fused parameter, grouped as engines fuse them again.

    ``gate_up_proj`` [E, 2I, H] gives, per expert, the group [(gate, [I, H]), (up, [I, H])]
    (one GEMM, one NVFP4 global scale); ``down_proj`` [E, H, I] gives [(down, [H, I])].
    Pieces are copies (safetensors refuses tensors that share memory).
    """
    names = split_names(name, list(t.shape))
    if name.endswith("down_proj"):
        return [[(names[e], t[e].clone())] for e in range(t.shape[0])]
    rows = t.shape[1]
    if rows % 2:
        raise ValueError(f"{name}: shape {tuple(t.shape)} is not [E, 2 * I, H]")
    half = rows // 2
    return [
        [(names[2 * e], t[e, :half].clone()), (names[2 * e + 1], t[e, half:].clone())]
        for e in range(t.shape[0])
    ]
