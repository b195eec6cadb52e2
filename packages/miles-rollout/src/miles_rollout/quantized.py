"""Low-precision rollout: the engine serves miles-quant formats (``EngineConfig.weight_format``).

Where the quantization happens: on the engine side, at every weight update. The trainer (and
every transfer method: push, p2p, delta) keeps sending its own tensors in the engine dtype, the
transfer's bit-for-bit verification keeps comparing exactly those, and the engine quantizes
what it received with miles-quant before the next forward. Because miles-quant is bit exact
across implementations, the trainer can check what is served without receiving it back:
:func:`served_digests` of its own tensors equals :meth:`Engine.served_weights_checksum`.

How the engine computes with them: each quantized weight is dequantized once per update into
the compute dtype (``dequantize(q, dtype)``), and the engine's GEMMs run on that tensor. That
is the arithmetic of a weight-only (W8A16 / W4A16) kernel that dequantizes on the fly, without
paying the dequantization on every forward: a CPU has no FP8 / FP4 / MX GEMMs to run natively
(measured in docs/benchmarks.md, "Low-precision rollout"). Activations stay in the compute
dtype.

Which weights: the miles-quant exporter's rules (``miles_quant.checkpoint``): floating-point
``*.weight`` matrices and 3-D fused MoE expert tensors, except embeddings, ``lm_head``, norms,
routers and biases (always kept), the ``keep_bf16`` patterns, the first / last N layers, and,
with ``quantize_only``, whatever those patterns do not name. Kept weights are served in the
engine dtype, unquantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "QUANT_FORMATS",
    "WEIGHT_FORMATS",
    "QuantizedWeights",
    "WeightSelection",
    "quantized_digest",
    "resolve_format",
    "select_weights",
    "served_digests",
]

# Recipe name -> miles-quant format. "mxfp8" is miles-quant's mxfp8_e4m3 (E4M3 elements, the
# variant MX weight GEMMs use).
QUANT_FORMATS: dict[str, str] = {
    "fp8_block128": "fp8_block128",
    "mxfp8": "mxfp8_e4m3",
    "mxfp8_e4m3": "mxfp8_e4m3",
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
    "int4_g32": "int4_g32",
    "int4_g128": "int4_g128",
}
# Unquantized formats and the engine dtype each one means.
_PLAIN = {"bf16": "bfloat16", "fp32": "float32"}
WEIGHT_FORMATS: tuple[str, ...] = (*_PLAIN, *QUANT_FORMATS)

# The input dim K must hold whole groups: the layouts SGLang loads (and miles-quant exports)
# have no partial groups, so a recipe that runs here runs there. fp8_block128 takes partial
# 128x128 tiles (DeepSeek's layout does).
_K_MULTIPLE = {
    "fp8_block128": 1,
    "mxfp8_e4m3": 32,
    "nvfp4": 16,
    "mxfp4": 32,
    "int4_g32": 32,
    "int4_g128": 128,
}
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


def resolve_format(weight_format: str | None, dtype: str) -> str | None:
    """The miles-quant format a ``weight_format`` names (``None``: unquantized).

    Raises:
        ValueError: an unknown format, or ``bf16`` / ``fp32`` that disagree with ``dtype``.
    """
    if weight_format is None:
        return None
    if weight_format in _PLAIN:
        if _PLAIN[weight_format] != dtype:
            raise ValueError(
                f"engine.weight_format {weight_format!r} serves unquantized "
                f"{_PLAIN[weight_format]} weights but engine.dtype is {dtype!r}; set "
                f"engine.dtype: {_PLAIN[weight_format]} (or leave weight_format unset)"
            )
        return None
    if weight_format not in QUANT_FORMATS:
        raise ValueError(
            f"engine.weight_format {weight_format!r} cannot be served by the embedded engine; "
            f"choose one of {list(WEIGHT_FORMATS)} (miles-quant format names)"
        )
    return QUANT_FORMATS[weight_format]


def _layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(kw_only=True, slots=True)
class WeightSelection:
    """Which parameters are quantized and why the others are not.

    Attributes:
        format: the miles-quant format.
        quantized: parameter names served quantized, in module order.
        kept: candidate names served unquantized -> the reason ("always kept", "keep_bf16",
            "first layers", "last layers", "not in quantize_only").
    """

    format: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def select_weights(
    params: Mapping[str, torch.Tensor],
    fmt: str,
    *,
    keep_bf16: Sequence[str] = (),
    keep_first_layers: int = 0,
    keep_last_layers: int = 0,
    quantize_only: Sequence[str] | None = None,
    num_layers: int = 0,
) -> WeightSelection:
    """Apply miles-quant's selection rules to a module's parameters (HF names).

    Raises:
        ValueError: a pattern that matches no parameter, a first/last layer count beyond the
            model's layers, a quantized weight whose input dim is not a multiple of the
            format's group (the message names it and the ``keep_bf16`` fix), or nothing left to
            quantize.
    """
    from miles_quant.checkpoint import ALWAYS_KEEP, matches

    names = list(params)
    for what, pats in (("keep_bf16", keep_bf16), ("quantize_only", quantize_only or ())):
        if isinstance(pats, str):
            raise ValueError(f"engine.{what} takes a list of patterns, got the string {pats!r}")
        for p in pats:
            if not isinstance(p, str) or not p:
                raise ValueError(f"engine.{what} patterns must be non-empty strings, got {p!r}")
            try:
                hit = any(matches(n, p) for n in names)
            except re.error as e:
                raise ValueError(f"engine.{what}: bad regular expression {p!r}: {e}") from e
            if not hit:
                raise ValueError(
                    f"engine.{what} pattern {p!r} matches no parameter of the model (names look "
                    f"like {names[1] if len(names) > 1 else names[0]!r}); fix or drop it"
                )
    for what, n in (
        ("keep_first_layers", keep_first_layers),
        ("keep_last_layers", keep_last_layers),
    ):
        if n > num_layers:
            raise ValueError(
                f"engine.{what} is {n} but the model has {num_layers} layers; use at most "
                f"{num_layers}"
            )
    sel = WeightSelection(format=fmt)
    for name in names:
        t = params[name]
        dim = t.dim()
        if t.dtype not in _FLOAT or not ((dim == 2 and name.endswith(".weight")) or dim == 3):
            continue
        idx = _layer_index(name)
        if any(matches(name, p) for p in ALWAYS_KEEP):
            why = "always kept"
        elif any(matches(name, p) for p in keep_bf16):
            why = "keep_bf16"
        elif idx is not None and idx < keep_first_layers:
            why = "first layers"
        elif idx is not None and keep_last_layers and idx >= num_layers - keep_last_layers:
            why = "last layers"
        elif quantize_only is not None and not any(matches(name, p) for p in quantize_only):
            why = "not in quantize_only"
        else:
            k = int(t.shape[-1])
            mult = _K_MULTIPLE[fmt]
            if k % mult:
                raise ValueError(
                    f"engine.weight_format {fmt!r} cannot serve {name} (shape "
                    f"{tuple(t.shape)}): its input dim {k} is not a multiple of the format's "
                    f"group ({mult}); keep it unquantized with engine.keep_bf16: [{name!r}] "
                    "or pick a format with a smaller group"
                )
            sel.quantized.append(name)
            continue
        sel.kept[name] = why
    if not sel.quantized:
        raise ValueError(
            f"engine.weight_format {fmt!r} leaves no weight to quantize (every candidate is "
            "kept by keep_bf16 / keep_first_layers / keep_last_layers / quantize_only); relax "
            "them or drop weight_format"
        )
    return sel


def quantized_digest(q: Any) -> str:
    """A digest of a ``miles_quant.QuantizedTensor``: its format, codes, scales and global
    scale (each ``miles_transfer.tensor_digest``), joined with ``:``."""
    from miles_transfer import tensor_digest

    parts = [q.format, tensor_digest(q.data), tensor_digest(q.scales)]
    if q.global_scale is not None:
        parts.append(tensor_digest(q.global_scale))
    return ":".join(parts)


def _quantize(w: torch.Tensor, fmt: str, out: Any = None, backend: str = "auto") -> Any:
    import miles_quant as mq

    return mq.quantize(w, fmt, stacked=w.dim() == 3, out=out, backend=backend)  # type: ignore[arg-type]


class QuantizedWeights:
    """The engine's quantized weights: codes per parameter plus their dequantized copies.

    ``refresh`` re-quantizes from the HF parameters (the received weights, in the engine
    dtype) into reused buffers; the runner computes with :meth:`served` tensors.

    Args:
        params: the module's parameters by HF name (the module's own names).
        selection: what to quantize (see :func:`select_weights`).
        dtype: the compute dtype the weights are dequantized to.
    """

    def __init__(
        self, params: Mapping[str, torch.Tensor], selection: WeightSelection, dtype: torch.dtype
    ) -> None:
        self.selection = selection
        self.format = selection.format
        self.dtype = dtype
        self._params = {n: params[n] for n in selection.quantized}
        self._q: dict[str, Any] = {}
        self._deq: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, torch.Tensor] = {}
        # Storage -> quantized names: an update through any name (an expert alias is a view
        # of a fused tensor) re-quantizes the parameters that share its memory.
        self._by_storage: dict[int, list[str]] = {}
        for n, p in self._params.items():
            self._by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(n)
        self.refresh()

    @property
    def names(self) -> list[str]:
        """The quantized parameter names."""
        return list(self._params)

    def refresh(self, touched: Iterable[torch.Tensor] | None = None) -> int:
        """Re-quantize (and dequantize) the parameters behind ``touched`` tensors (all when
        ``None``); returns how many were refreshed. Call with every forward stopped."""
        import miles_quant as mq

        if touched is None:
            todo = list(self._params)
        else:
            seen: set[str] = set()
            for t in touched:
                seen.update(self._by_storage.get(t.untyped_storage().data_ptr(), ()))
            todo = [n for n in self._params if n in seen]
        with torch.inference_mode():
            for n in todo:
                p = self._params[n]
                q = _quantize(p, self.format, out=self._q.get(n))
                self._q[n] = q
                deq = mq.dequantize(q, self.dtype, out=self._deq.get(n))
                self._deq[n] = deq
                self._by_id[id(p)] = deq
        return len(todo)

    def served(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the engine computes with in place of an HF parameter."""
        return self._by_id.get(id(param), param)

    def quantized(self, name: str) -> Any:
        """The ``QuantizedTensor`` served for a quantized parameter."""
        return self._q[name]

    def dequantized(self, name: str) -> torch.Tensor:
        """The dequantized copy the engine computes with for a quantized parameter."""
        return self._deq[name]

    def nbytes(self) -> int:
        """Bytes of the codes and scales (what a GPU engine would hold for these weights)."""
        total = 0
        for q in self._q.values():
            total += q.data.numel() * q.data.element_size()
            total += q.scales.numel() * q.scales.element_size()
        return total


def served_digests(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    selection: WeightSelection,
    dtype: torch.dtype,
    *,
    backend: str = "auto",
) -> dict[str, str]:
    """What an engine serving ``selection`` reports for these tensors, computed elsewhere.

    Each tensor is cast to the engine ``dtype`` as a weight update does; quantized names get
    :func:`quantized_digest` of ``miles_quant.quantize`` of it, the others the plain
    ``tensor_digest``. miles-quant's backends agree bit for bit, so the trainer (any backend)
    can check the engine's :meth:`~miles_rollout.Engine.served_weights_checksum`.
    """
    from miles_transfer import tensor_digest

    quantized = set(selection.quantized)
    out: dict[str, str] = {}
    for name, t in named_tensors:
        w = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        if name in quantized:
            out[name] = quantized_digest(_quantize(w, selection.format, backend=backend))
        else:
            out[name] = tensor_digest(w)
    return out
