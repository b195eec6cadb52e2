"""The on-disk layouts engines load, one per format: tensor names, dtypes, shapes and the
``quantization_config`` that announces them (README "Checkpoints" has the table).

For a quantized parameter ``P`` (``model.layers.0.mlp.down_proj.weight``, or a fused expert
parameter ``model.layers.0.mlp.experts.gate_up_proj``):

- DeepSeek FP8 blockwise (fp8_block128): ``P`` float8_e4m3fn [..., N, K] and ``P_scale_inv``
  float32 [..., ceil(N/128), ceil(K/128)] (the dequantization multiplier).
- ModelOpt NVFP4 (nvfp4): ``P`` uint8 [..., N, K/2], ``P_scale`` float8_e4m3fn [..., N, K/16],
  ``P_scale_2`` float32 [] ([E] for a fused [E, N, K] parameter), and the module's
  ``input_scale`` float32 [] (activation global scale, amax / 2688: miles_quant.calibrate).
- gpt-oss MXFP4 (mxfp4): ``P_blocks`` uint8 [..., N, K/32, 16] and ``P_scales`` uint8
  [..., N, K/32] (E8M0 codes).
- compressed-tensors INT4 pack-quantized (int4_g32, int4_g128): ``P_packed`` int32
  [..., N, K/8] (eight offset-binary nibbles, element 0 in bits 0-3), ``P_scale`` [..., N, K/g]
  in the source dtype, ``P_shape`` int64 [dims].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from miles_quant._api import QuantizedTensor
from miles_quant.version import __version__

__all__ = ["LAYOUTS", "Layout", "decode", "encode", "input_scale_name", "layout_of_config"]


@dataclass(frozen=True, slots=True)
class Layout:
    """One checkpoint layout: the format it stores and the shape rule it needs."""

    name: str
    format: str
    k_multiple: int  # the last dim must be a multiple of this
    description: str


LAYOUTS: dict[str, Layout] = {
    "fp8_block128": Layout("deepseek-fp8", "fp8_block128", 1, "DeepSeek FP8 128x128 blockwise"),
    "nvfp4": Layout("modelopt-nvfp4", "nvfp4", 16, "ModelOpt NVFP4"),
    "mxfp4": Layout("gpt-oss-mxfp4", "mxfp4", 32, "gpt-oss MXFP4"),
    "int4_g32": Layout("compressed-tensors", "int4_g32", 32, "compressed-tensors W4A16 g32"),
    "int4_g128": Layout("compressed-tensors", "int4_g128", 128, "compressed-tensors W4A16 g128"),
}


def input_scale_name(param: str) -> str:
    """ModelOpt's activation scale of the module owning ``param``."""
    if param.endswith(".weight"):
        return param[: -len("weight")] + "input_scale"
    return param + "_input_scale"


def encode(param: str, q: QuantizedTensor, input_scale: float) -> dict[str, torch.Tensor]:
    """The tensors that store ``q`` (the quantized ``param``) in its format's layout."""
    fmt = q.format
    if fmt == "fp8_block128":
        return {param: q.data, param + "_scale_inv": q.scales}
    if fmt == "nvfp4":
        assert q.global_scale is not None
        return {
            param: q.data,
            param + "_scale": q.scales,
            param + "_scale_2": q.global_scale,
            input_scale_name(param): torch.tensor(input_scale, dtype=torch.float32),
        }
    if fmt == "mxfp4":
        *lead, half_k = q.data.shape
        return {
            param + "_blocks": q.data.reshape(*lead, half_k // 16, 16),
            param + "_scales": q.scales.view(torch.uint8),
        }
    assert fmt in ("int4_g32", "int4_g128"), fmt
    return {
        # Little-endian int32 words of the packed bytes: element 0 in bits 0-3.
        param + "_packed": q.data.view(torch.int32),
        param + "_scale": q.scales,
        param + "_shape": torch.tensor(q.shape, dtype=torch.int64),
    }


# Suffix that marks a quantized parameter in each layout, and its companions.
_MARKERS = {
    "fp8_block128": "_scale_inv",
    "nvfp4": "_scale_2",
    "mxfp4": "_scales",
    "int4_g32": "_packed",
    "int4_g128": "_packed",
}


def quantized_params(fmt: str, names: list[str]) -> list[str]:
    """Names of the quantized parameters ``P`` found among a checkpoint's tensor names."""
    marker = _MARKERS[fmt]
    out = []
    for n in names:
        if n.endswith(marker):
            base = n[: -len(marker)]
            if fmt == "mxfp4" and not base + "_blocks" in names:  # noqa: E713
                continue
            out.append(base)
    return out


def stored_names(fmt: str, param: str) -> list[str]:
    """Every tensor name the layout writes for ``param``."""
    if fmt == "fp8_block128":
        return [param, param + "_scale_inv"]
    if fmt == "nvfp4":
        return [param, param + "_scale", param + "_scale_2", input_scale_name(param)]
    if fmt == "mxfp4":
        return [param + "_blocks", param + "_scales"]
    return [param + "_packed", param + "_scale", param + "_shape"]


def decode(
    fmt: str, param: str, t: dict[str, torch.Tensor], dtype: torch.dtype, scale_rule: str | None
) -> QuantizedTensor:
    """Rebuild the QuantizedTensor of ``param`` from its stored tensors ``t`` (by name).

    Raises:
        ValueError: a companion tensor is missing or its dtype/shape is not the layout's.
    """

    def need(name: str, want: torch.dtype | tuple[torch.dtype, ...]) -> torch.Tensor:
        if name not in t:
            raise ValueError(f"{param}: the {fmt} layout needs tensor {name!r}, not found")
        v = t[name]
        wants = want if isinstance(want, tuple) else (want,)
        if v.dtype not in wants:
            raise ValueError(f"{name}: expected dtype {wants}, got {v.dtype}")
        return v

    if fmt == "fp8_block128":
        data = need(param, torch.float8_e4m3fn)
        scales = need(param + "_scale_inv", torch.float32)
        shape = tuple(data.shape)
        if data.dim() < 2:
            raise ValueError(f"{param}: an FP8 block weight must be [..., N, K], got {shape}")
        want = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
        if tuple(scales.shape) != want:
            raise ValueError(f"{param}_scale_inv: expected shape {want}, got {tuple(scales.shape)}")
        return QuantizedTensor(data, scales, fmt, shape, dtype, "128x128")
    if fmt == "nvfp4":
        data = need(param, torch.uint8)
        scales = need(param + "_scale", torch.float8_e4m3fn)
        g = need(param + "_scale_2", torch.float32)
        shape = (*data.shape[:-1], 2 * data.shape[-1])
        want = (*shape[:-1], shape[-1] // 16)
        if tuple(scales.shape) != want:
            raise ValueError(f"{param}_scale: expected shape {want}, got {tuple(scales.shape)}")
        stacked = g.dim() == 1
        if stacked and (data.dim() != 3 or g.shape[0] != data.shape[0]):
            raise ValueError(f"{param}_scale_2: shape {tuple(g.shape)} does not fit {shape}")
        if not stacked and g.dim() != 0:
            g = g.reshape(())  # some exporters write [1]
        return QuantizedTensor(data, scales, fmt, shape, dtype, "1x16", None, g, stacked)
    if fmt == "mxfp4":
        blocks = need(param + "_blocks", torch.uint8)
        s = need(param + "_scales", torch.uint8)
        if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(s.shape) != tuple(blocks.shape[:-1]):
            raise ValueError(
                f"{param}_blocks / _scales: expected [..., G, 16] and [..., G], got "
                f"{tuple(blocks.shape)} and {tuple(s.shape)}"
            )
        *lead, groups, _ = blocks.shape
        data = blocks.reshape(*lead, groups * 16)
        shape = (*lead, groups * 32)
        scales = s.view(torch.float8_e8m0fnu)
        return QuantizedTensor(data, scales, fmt, shape, dtype, "1x32", scale_rule or "floor")
    group = 32 if fmt == "int4_g32" else 128
    packed = need(param + "_packed", torch.int32)
    scales = need(param + "_scale", (torch.float32, torch.bfloat16, torch.float16))
    shape = tuple(int(v) for v in need(param + "_shape", (torch.int64, torch.int32)).tolist())
    if len(shape) != packed.dim() or shape[-1] != 8 * packed.shape[-1]:
        raise ValueError(
            f"{param}_shape {shape} does not fit {param}_packed {tuple(packed.shape)} "
            "(pack-quantized along the last dim, 8 values per int32)"
        )
    want = (*shape[:-1], math.ceil(shape[-1] / group))
    if tuple(scales.shape) != want:
        raise ValueError(f"{param}_scale: expected shape {want}, got {tuple(scales.shape)}")
    data = packed.contiguous().view(torch.uint8)
    return QuantizedTensor(data, scales, fmt, shape, dtype, f"1x{group}")


def modules_of(params: list[str]) -> list[str]:
    """Module names of Linear weights (``a.b.weight`` -> ``a.b``); other names unchanged."""
    return [p[: -len(".weight")] if p.endswith(".weight") else p for p in params]


def quantization_config(
    fmt: str, kept_modules: list[str], scale_rule: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json ``quantization_config``, extra JSON files by name) for a layout.

    ``kept_modules`` are the Linear modules (and fused parameters) left unquantized; each
    layout names them under the key its loaders read.
    """
    kept = sorted(kept_modules)
    cfg: dict[str, Any]
    producer = {"name": "miles-quant", "version": __version__}
    if fmt == "fp8_block128":
        cfg = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "ignored_layers": kept,  # vLLM / SGLang
            "modules_to_not_convert": kept,  # transformers FineGrainedFP8
        }
        return cfg, {}
    if fmt == "nvfp4":
        cfg = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "ignore": kept,  # flat (config.json) form
            "exclude_modules": kept,
            "producer": producer,
        }
        hf_quant: dict[str, Any] = {
            "producer": producer,
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": None,
                "group_size": 16,
                "exclude_modules": kept,
            },
        }
        return cfg, {"hf_quant_config.json": hf_quant}
    if fmt == "mxfp4":
        cfg = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": kept,
            "scale_rule": scale_rule or "floor",  # informational; the scales are stored
        }
        return cfg, {}
    group = 32 if fmt == "int4_g32" else 128
    weights: dict[str, Any] = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": kept,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }
    return cfg, {}


def layout_of_config(qcfg: dict[str, Any]) -> tuple[str, str | None]:
    """(format, scale_rule) of a checkpoint's ``quantization_config``.

    Raises:
        ValueError: a quantization this module does not read.
    """
    method = str(qcfg.get("quant_method", ""))
    if method == "fp8":
        block = qcfg.get("weight_block_size")
        if list(block or []) != [128, 128]:
            raise ValueError(f"fp8 checkpoint with weight_block_size {block}; only [128, 128]")
        return "fp8_block128", None
    if method in ("modelopt", "modelopt_fp4"):
        algo = qcfg.get("quant_algo") or qcfg.get("quantization", {}).get("quant_algo")
        if algo != "NVFP4":
            raise ValueError(f"ModelOpt checkpoint with quant_algo {algo!r}; only NVFP4")
        return "nvfp4", None
    if method == "mxfp4":
        return "mxfp4", qcfg.get("scale_rule")
    if method == "compressed-tensors":
        if qcfg.get("format") != "pack-quantized":
            raise ValueError(
                f"compressed-tensors format {qcfg.get('format')!r}; only pack-quantized"
            )
        groups = list((qcfg.get("config_groups") or {}).values())
        w = groups[0].get("weights", {}) if groups else {}
        ok = w.get("num_bits") == 4 and w.get("symmetric") and w.get("strategy") == "group"
        if len(groups) != 1 or not ok or w.get("group_size") not in (32, 128):
            raise ValueError(
                "compressed-tensors: only one config group of symmetric 4-bit weights in "
                f"groups of 32 or 128 is read, got {groups}"
            )
        return f"int4_g{w['group_size']}", None
    raise ValueError(
        f"unknown quantization_config quant_method {method!r}; miles_quant reads fp8 "
        "(DeepSeek blockwise), modelopt (NVFP4), mxfp4 (gpt-oss) and compressed-tensors "
        "(pack-quantized INT4)"
    )
