"""Quantized Hugging Face checkpoints in the layouts inference engines load.

``export_checkpoint`` converts an HF safetensors model directory to one of four layouts
(DeepSeek FP8 blockwise, ModelOpt NVFP4, gpt-oss MXFP4, compressed-tensors INT4
pack-quantized; see `LAYOUTS`), tensor by tensor, with the bits of `miles_quant.quantize`.
``load_quantized`` / ``iter_quantized`` read such a directory back (as QuantizedTensors or
dequantized), and ``dequantize_checkpoint`` writes a plain HF directory from one.

    from miles_quant.checkpoint import export_checkpoint, load_quantized
    export_checkpoint("qwen3-bf16", "qwen3-w4a16", "int4_g128", only=["*.experts.*"])
    state = load_quantized("qwen3-w4a16", dtype=torch.bfloat16)   # HF names, dequantized

Needs safetensors (``pip install 'miles-quant[checkpoint]'``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_quant._api import Backend, QuantizedTensor, dequantize, quantize
from miles_quant._checkpoint_experts import split_experts, split_names, splits
from miles_quant._checkpoint_io import (
    DEFAULT_MAX_SHARD_BYTES,
    AtomicDir,
    ShardWriter,
    TensorReader,
    check_destination,
    copy_side_files,
)
from miles_quant._checkpoint_layouts import (
    LAYOUTS,
    Layout,
    decode,
    encode,
    layout_of_config,
    modules_of,
    quantization_config,
    quantized_params,
    stored_names,
)
from miles_quant._checkpoint_select import ALWAYS_KEEP, Selector, check_pattern_list, matches
from miles_quant.calibrate import input_scale

__all__ = [
    "ALWAYS_KEEP",
    "LAYOUTS",
    "ExportPlan",
    "Layout",
    "dequantize_checkpoint",
    "export_checkpoint",
    "iter_quantized",
    "load_quantized",
    "matches",
    "plan_export",
]

Progress = Callable[[int, int, str], None]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# NVFP4 has a per-tensor global scale; engines fuse these projections into one GEMM with one
# global scale, so their members are quantized together (as the fused tensor).
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


@dataclass(slots=True)
class ExportPlan:
    """What `export_checkpoint` will do (or did) with each tensor.

    Attributes:
        format: the quantization format.
        layout: the checkpoint layout written.
        quantized: names of the source tensors that are quantized, in file order.
        kept: source tensor name -> why it stays in source precision.
        fused: NVFP4 only: groups of tensors quantized together (one global scale).
        split: fused expert parameters (``mlp.experts.gate_up_proj`` / ``down_proj`` of
            Qwen2/3-MoE-style models) -> the per-expert tensor names written for them (the
            names engines load; gate and up of one expert form an NVFP4 group).
        input_scales: NVFP4 only, filled by `export_checkpoint`: each quantized module ->
            the ``input_scale`` written for it (1.0 where ``input_amax`` had no value for it).
    """

    format: str
    layout: Layout
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    fused: list[list[str]] = field(default_factory=list)
    split: dict[str, list[str]] = field(default_factory=dict)
    input_scales: dict[str, float] = field(default_factory=dict)


def _read_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{os.fspath(model_dir)!r} is not a directory (an HF model dir)")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{os.fspath(model_dir)!r} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(model_dir / 'config.json')}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{os.fspath(model_dir / 'config.json')}: expected a JSON object")
    return cfg


def _input_dim_first(cfg: dict[str, Any], name: str, ndim: int) -> bool:
    """Whether ``name`` is stored [E, in, out] (x @ W) rather than [E, out, in] (F.linear).

    gpt-oss keeps its fused experts that way in memory and in BF16 checkpoints, while its MXFP4
    checkpoint quantizes along the input dim ([E, out, in / 32, 16] blocks): such parameters
    are transposed before quantizing (every layout groups along the input dim) and back after
    dequantizing.
    """
    return (
        cfg.get("model_type") == "gpt_oss"
        and ndim == 3
        and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    )


def _config_dtype(cfg: dict[str, Any]) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return _DTYPES.get(str(name), torch.bfloat16)


def _check_format(fmt: str) -> Layout:
    if fmt not in LAYOUTS:
        raise ValueError(
            f"no checkpoint layout for format {fmt!r}; choose one of {sorted(LAYOUTS)} "
            "(fp8_block128: DeepSeek FP8, nvfp4: ModelOpt, mxfp4: gpt-oss, int4_g32/int4_g128: "
            "compressed-tensors pack-quantized)"
        )
    return LAYOUTS[fmt]


def _fusion_groups(names: list[str]) -> list[list[str]]:
    present = set(names)
    groups = []
    for n in names:
        if not n.endswith(".weight"):
            continue
        parent, _, leaf = n[: -len(".weight")].rpartition(".")
        for members in _FUSED:
            if leaf == members[0]:
                group = [f"{parent}.{m}.weight" if parent else f"{m}.weight" for m in members]
                if all(g in present for g in group):
                    groups.append(group)
    return groups


def plan_export(
    src_dir: str | os.PathLike[str],
    fmt: str,
    *,
    keep_bf16: Sequence[str] = (),
    keep_first_layers: int = 0,
    keep_last_layers: int = 0,
    only: Sequence[str] | None = None,
) -> ExportPlan:
    """Decide which tensors `export_checkpoint` quantizes, without converting anything.

    Arguments as in `export_checkpoint`. Reads only the safetensors headers.

    Raises:
        ValueError, FileNotFoundError: as `export_checkpoint`, for everything but the output.
    """
    layout = _check_format(fmt)
    check_pattern_list(keep_bf16, "keep_bf16")
    check_pattern_list(only, "only")
    src = Path(src_dir)
    cfg = _read_config(src)
    if "quantization_config" in cfg:
        raise ValueError(
            f"{os.fspath(src)!r} is already quantized "
            f"({cfg['quantization_config'].get('quant_method')!r}); convert a BF16/FP16/FP32 "
            "checkpoint (dequantize_checkpoint makes one)"
        )
    plan = ExportPlan(fmt, layout)
    with TensorReader(src) as reader:
        num_layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0)
        selector = Selector(
            keep=tuple(keep_bf16),
            keep_first_layers=keep_first_layers,
            keep_last_layers=keep_last_layers,
            only=None if only is None else tuple(only),
            num_layers=num_layers,
        )
        if (keep_first_layers or keep_last_layers) and num_layers <= 0:
            raise ValueError(
                "keep_first_layers / keep_last_layers need num_hidden_layers in config.json"
            )
        for name in reader.names:
            shape, dtype = reader.meta(name)
            if splits(cfg, name, len(shape)):
                plan.split[name] = split_names(name, shape)
            why = selector.reason_kept(name, dtype, shape)
            if why is not None:
                plan.kept[name] = why
                continue
            k = shape[-2] if _input_dim_first(cfg, name, len(shape)) else shape[-1]
            if k % layout.k_multiple:
                raise ValueError(
                    f"{name} has shape {shape}: the {layout.description} layout needs the "
                    f"input dim ({k}) to be a multiple of {layout.k_multiple}; keep it in source "
                    f"precision (keep_bf16=[{name!r}], CLI: --keep {name})"
                )
            plan.quantized.append(name)
        if only is not None and not any(
            matches(n, p) for n in reader.names for p in selector.only or ()
        ):
            raise ValueError(
                f"only={list(only)} matches no tensor of {os.fspath(src)!r} (names look like "
                f"{reader.names[0] if reader.names else '-'!r}); fix the patterns"
            )
    if fmt == "nvfp4":
        quantized = set(plan.quantized)
        for group in _fusion_groups(list(reader.names)):
            inside = [g for g in group if g in quantized]
            if inside and len(inside) != len(group):
                raise ValueError(
                    f"{group} are fused into one GEMM by engines and share one NVFP4 global "
                    f"scale, but only {inside} would be quantized; keep all or none of them"
                )
            if inside:
                plan.fused.append(group)
    return plan


def _input_scale(amax: float | Mapping[str, float] | None, params: list[str]) -> float:
    """input_scale of an NVFP4 group: fp32(amax) / 2688 in fp32 (1.0 without an amax).

    A group (q/k/v, gate/up) shares one input, and engines take the max over its members'
    input scales anyway, so the group gets the largest of its members' amaxes.
    """
    if amax is None:
        return 1.0
    if isinstance(amax, (int, float)):
        value = float(amax)
    else:
        found = [amax[m] for m in modules_of(params) if m in amax]
        if not found:
            return 1.0
        value = max(float(v) for v in found)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(
            f"input_amax must be finite and > 0, got {value} for {params}; recalibrate, or "
            "leave the module out of input_amax (input_scale 1.0) or keep it unquantized"
        )
    return float(input_scale(value, "nvfp4"))


def _check_amax_names(amax: Mapping[str, float], plan: ExportPlan) -> None:
    """Refuses an ``input_amax`` none of whose names is a quantized module: every module
    would silently get input_scale 1.0 (typically keys with a ``.weight`` suffix)."""
    params = [out for name in plan.quantized for out in plan.split.get(name, [name])]
    modules = set(modules_of(params))
    if not modules or any(k in modules for k in amax):
        return
    raise ValueError(
        f"input_amax names no quantized module of this checkpoint (e.g. {next(iter(amax))!r}); "
        f"keys are module names such as {sorted(modules)[0]!r} (no '.weight' suffix), as "
        "Calibration.amax has them"
    )


def export_checkpoint(
    src_dir: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    fmt: str,
    *,
    keep_bf16: Sequence[str] = (),
    keep_first_layers: int = 0,
    keep_last_layers: int = 0,
    only: Sequence[str] | None = None,
    scale_rule: str | None = None,
    input_amax: float | Mapping[str, float] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    backend: Backend = "auto",
    progress: Progress | None = None,
) -> ExportPlan:
    """Quantize an HF safetensors checkpoint into the layout engines load for ``fmt``.

    Streams: one tensor (or one NVFP4 fusion group) is in memory at a time, and output shards
    are flushed at ``max_shard_bytes``. Quantized tensors carry exactly the bits of
    ``quantize(t, fmt)`` on the source tensor ``t`` (NVFP4 fusion groups: of ``quantize`` on
    the members concatenated along dim 0, then split). Kept tensors are copied bit for bit.
    config.json gets the layout's ``quantization_config`` (and ModelOpt's hf_quant_config.json
    is written); tokenizer and other side files are copied. The directory appears atomically:
    on any error nothing is left at ``dst_dir``.

    Args:
        src_dir: an HF model directory (config.json, model.safetensors or an index + shards).
        dst_dir: the directory to create.
        fmt: "fp8_block128", "nvfp4", "mxfp4", "int4_g32" or "int4_g128" (see `LAYOUTS`).
        keep_bf16: patterns of tensors kept in source precision (globs on tensor or module
            names, or "re:" + a regex), in addition to `ALWAYS_KEEP`.
        keep_first_layers: keep the first N transformer layers unquantized.
        keep_last_layers: keep the last N transformer layers unquantized.
        only: quantize only tensors matching one of these patterns (e.g. ["*.experts.*"]).
        scale_rule: mxfp4 only: "floor" (default), "rceil" or "even".
        input_amax: nvfp4 only: activation amax per module name (or one value for all), from
            calibration (`miles_quant.calibrate`: ``Calibration.amax``); input_scale =
            fp32(amax) / 2688 in fp32, the max over a fused group. Modules without a value
            get 1.0 (block scales then cover activation block amax from 6 * 2^-9 to 2688);
            ``ExportPlan.input_scales`` says what each module got. A mapping none of whose
            names is a quantized module is refused.
        max_shard_bytes: largest output shard.
        overwrite: replace an existing ``dst_dir``.
        backend: quantize backend ("auto", "native", "torch"); all give the same bits.
        progress: called as ``progress(done, total, name)`` after each source tensor.

    Returns:
        The ExportPlan that was carried out.

    Raises:
        ValueError: unknown format, a shape the layout cannot take, bad patterns, an already
            quantized source, a partially kept NVFP4 fusion group, an ``input_amax`` that
            names no quantized module or holds a value that is not finite and > 0.
        FileNotFoundError: missing directory, config.json or weights.
        FileExistsError: ``dst_dir`` exists and ``overwrite`` is False.
    """
    if scale_rule is not None and fmt != "mxfp4":
        raise ValueError(f"scale_rule applies to mxfp4 only, not {fmt}")
    if input_amax is not None and fmt != "nvfp4":
        raise ValueError(f"input_amax applies to nvfp4 only, not {fmt}")
    plan = plan_export(
        src_dir,
        fmt,
        keep_bf16=keep_bf16,
        keep_first_layers=keep_first_layers,
        keep_last_layers=keep_last_layers,
        only=only,
    )
    if isinstance(input_amax, Mapping) and input_amax:
        _check_amax_names(input_amax, plan)
    src, dst = Path(src_dir), Path(dst_dir)
    check_destination(dst, src, overwrite)
    cfg = _read_config(src)
    quantized = set(plan.quantized)
    group_of = {m: g for g in plan.fused for m in g}
    done: set[str] = set()
    kept_weights: list[str] = []  # output names of kept weight matrices (the ignore lists)
    with TensorReader(src) as reader, AtomicDir(dst) as out:
        writer = ShardWriter(out.tmp, max_shard_bytes)
        total = len(reader.names)
        for name in reader.names:
            if name in done:
                continue
            members = group_of.get(name, [name])
            if name in plan.split:
                groups = split_experts(name, reader.get(name))
            else:
                groups = [[(m, reader.get(m)) for m in members]]
            for group in groups:
                if name not in quantized:
                    for out_name, t in group:
                        writer.add(out_name, t)
                        if plan.kept[name] != "not a weight matrix":
                            kept_weights.append(out_name)
                    continue
                # NVFP4 quantizes a group as one tensor (one global scale); other formats
                # have only local scales, so each member is quantized on its own.
                parts = [group] if fmt == "nvfp4" else [[m] for m in group]
                for part in parts:
                    scale_in = _write_quantized(
                        writer, part, fmt, cfg, scale_rule, input_amax, backend, name
                    )
                    if fmt == "nvfp4":
                        for m in modules_of([n for n, _ in part]):
                            plan.input_scales[m] = scale_in
            done.update(members)
            if progress is not None:
                progress(len(done), total, name)
        writer.close()
        kept_modules = modules_of(kept_weights)
        qcfg, extra = quantization_config(fmt, kept_modules, scale_rule)
        cfg["quantization_config"] = qcfg
        (out.tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for fname, content in extra.items():
            (out.tmp / fname).write_text(json.dumps(content, indent=2) + "\n")
        copy_side_files(src, out.tmp)
        out.commit()
    return plan


def _write_quantized(
    writer: ShardWriter,
    group: list[tuple[str, torch.Tensor]],
    fmt: str,
    cfg: dict[str, Any],
    scale_rule: str | None,
    input_amax: float | Mapping[str, float] | None,
    backend: Backend,
    source: str,
) -> float:
    """Quantize ``group`` (one tensor, or NVFP4 members concatenated along dim 0) and write
    each member in the layout; returns the NVFP4 input_scale written (1.0 otherwise)."""
    names = [n for n, _ in group]
    if len({t.dtype for _, t in group}) != 1:
        raise ValueError(f"fusion group {names} mixes dtypes")
    x = group[0][1] if len(group) == 1 else torch.cat([t for _, t in group], dim=0)
    if _input_dim_first(cfg, source, x.dim()):
        x = x.transpose(-1, -2)
    stacked = fmt == "nvfp4" and x.dim() == 3
    q = quantize(x, fmt, scale_rule=scale_rule, stacked=stacked, backend=backend)
    scale_in = _input_scale(input_amax, names) if fmt == "nvfp4" else 1.0
    for m, part in zip(names, _split_rows(q, [t.shape[0] for _, t in group])):
        for out_name, t in encode(m, part, scale_in).items():
            writer.add(out_name, t)
    return scale_in


def _split_rows(q: QuantizedTensor, rows: list[int]) -> list[QuantizedTensor]:
    """Split a QuantizedTensor of members concatenated along dim 0 (1x* groups only)."""
    if len(rows) == 1:
        return [q]
    out, start = [], 0
    for r in rows:
        sl = slice(start, start + r)
        out.append(
            QuantizedTensor(
                q.data[sl].clone(),
                q.scales[sl].clone(),
                q.format,
                (r, *q.shape[1:]),
                q.dtype,
                q.granularity,
                q.scale_rule,
                None if q.global_scale is None else q.global_scale.clone(),
                q.stacked,
            )
        )
        start += r
    return out


def iter_quantized(
    path: str | os.PathLike[str],
    *,
    dequantize_to: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Stream a quantized checkpoint written in one of the `LAYOUTS`, tensor by tensor.

    Args:
        path: the checkpoint directory.
        dequantize_to: None yields each quantized parameter as a QuantizedTensor under its
            HF name (``...down_proj.weight``) and every other stored tensor as it is (NVFP4
            ``input_scale`` included). A dtype yields the plain HF state instead: quantized
            parameters dequantized to that dtype, other tensors as stored, ``input_scale``
            left out.

    Raises:
        ValueError: not a quantized checkpoint, an unknown quantization, a broken layout.
        FileNotFoundError: missing directory, config.json or weights.
    """
    src = Path(path)
    cfg = _read_config(src)
    qcfg = cfg.get("quantization_config")
    if not isinstance(qcfg, dict):
        raise ValueError(
            f"{os.fspath(src)!r} has no quantization_config in config.json: not a quantized "
            "checkpoint"
        )
    fmt, rule = layout_of_config(qcfg)
    with TensorReader(src) as reader:
        dtype = _config_dtype(cfg)
        params = quantized_params(fmt, reader.names)
        companion = {n: p for p in params for n in stored_names(fmt, p)}
        for name in reader.names:
            param = companion.get(name)
            if param is None:
                yield name, reader.get(name)
                continue
            if fmt == "nvfp4" and name == stored_names(fmt, param)[3]:
                if dequantize_to is None:
                    yield name, reader.get(name)
                continue
            first = next(n for n in stored_names(fmt, param) if n in reader)
            if name != first:
                continue
            parts = {n: reader.get(n) for n in stored_names(fmt, param) if n in reader}
            q = decode(fmt, param, parts, dtype, rule)
            if dequantize_to is None:
                yield param, q
                continue
            w = dequantize(q, dequantize_to)
            if _input_dim_first(cfg, param, w.dim()):
                w = w.transpose(-1, -2).contiguous()
            yield param, w


def load_quantized(
    path: str | os.PathLike[str], *, dequantize: bool = True, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Read a whole quantized checkpoint (see `iter_quantized`, which streams).

    Args:
        path: the checkpoint directory.
        dequantize: True gives the plain HF state dict (quantized parameters dequantized);
            False gives QuantizedTensors for quantized parameters.
        dtype: dequantization dtype; default the checkpoint's config dtype (else bfloat16).

    Returns:
        name -> tensor (or QuantizedTensor), in file order.
    """
    to = None
    if dequantize:
        to = dtype if dtype is not None else _config_dtype(_read_config(Path(path)))
    return dict(iter_quantized(path, dequantize_to=to))


def dequantize_checkpoint(
    src_dir: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Write a plain HF checkpoint (no quantization_config) from a quantized one, streaming.

    Useful for an engine without the format's kernels, and to check a quantized checkpoint
    with transformers. Other tensors and side files are copied as they are.

    Returns:
        The output directory.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    cfg = _read_config(src)
    to = dtype if dtype is not None else _config_dtype(cfg)
    check_destination(dst, src, overwrite)
    with AtomicDir(dst) as out:
        writer = ShardWriter(out.tmp, max_shard_bytes)
        for k, (name, t) in enumerate(iter_quantized(src, dequantize_to=to)):
            assert isinstance(t, torch.Tensor)
            writer.add(name, t)
            if progress is not None:
                progress(k + 1, -1, name)
        writer.close()
        cfg.pop("quantization_config", None)
        cfg["dtype"] = {v: k for k, v in _DTYPES.items()}[to]
        (out.tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        copy_side_files(src, out.tmp)
        out.commit()
    return out.target
