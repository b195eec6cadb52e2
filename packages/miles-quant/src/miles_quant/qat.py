"""INT4 quantization-aware training: fake-quantized weights with a straight-through estimator.

The forward of every selected weight is ``dequantize(quantize(w, "int4_g128"), w.dtype)``:
the very function the exporter and the engine apply, so it is bit for bit what W4A16 rollout
serves (the scale is kept in ``w``'s dtype before the codes are computed: a bf16 model keeps a
bf16 scale, as the compressed-tensors checkpoint stores it). The backward is the identity
(the straight-through estimator): the gradient reaches the full-precision weight unchanged.

    from miles_quant.qat import apply_int4_qat
    handle = apply_int4_qat(model)                  # MoE expert weights, groups of 128
    loss = model(**batch).loss; loss.backward()     # trains through the fake quantizer
    handle.remove()                                 # back to the plain model

Export the trained model with ``miles_quant.checkpoint.export_checkpoint(src, dst,
"int4_g128", only=handle.patterns)`` from a checkpoint saved in the training compute dtype:
the codes are those the forward used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_quant._api import Backend, dequantize, quantize
from miles_quant._checkpoint_select import (
    DEFAULT_QAT_PATTERNS,
    _check_pattern,
    check_pattern_list,
    matches,
)

__all__ = ["DEFAULT_QAT_PATTERNS", "QATHandle", "apply_int4_qat", "fake_quantize_int4"]

_GROUPS = (32, 128)


class _FakeQuantInt4(torch.autograd.Function):
    """Forward: INT4 quantize-then-dequantize. Backward: the identity."""

    @staticmethod
    def forward(
        ctx: Any,
        w: torch.Tensor,
        fmt: str,
        scale_dtype: torch.dtype | None,
        backend: Backend,
    ) -> torch.Tensor:
        q = quantize(w.detach(), fmt, scale_dtype=scale_dtype, backend=backend)
        # dequantize's native kernels run on CPU; on another device its torch ops (same bits).
        back: Backend = backend if w.device.type == "cpu" else "auto"
        return dequantize(q, w.dtype, backend=back)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


def _check_group(group: int) -> str:
    if group not in _GROUPS:
        raise ValueError(f"INT4 QAT group must be one of {_GROUPS}, got {group}")
    return f"int4_g{group}"


def fake_quantize_int4(
    w: torch.Tensor,
    *,
    group: int = 128,
    scale_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """INT4 fake quantization with a straight-through estimator.

    Args:
        w: float32, bfloat16 or float16 weight [..., K]; groups run along K.
        group: 32 or 128 (``int4_g32`` / ``int4_g128``).
        scale_dtype: storage dtype of the scale the codes are computed against (default
            ``w.dtype``; see docs/contract.md, INT4).
        backend: quantize and dequantize backend (dequantize's native kernels are CPU-only: on
            another device it uses torch ops); all give the same bits.

    Returns:
        ``dequantize(quantize(w, f"int4_g{group}", scale_dtype=scale_dtype), w.dtype)``, whose
        gradient with respect to ``w`` is the identity.
    """
    fmt = _check_group(group)
    out = _FakeQuantInt4.apply(w, fmt, scale_dtype, backend)
    assert isinstance(out, torch.Tensor)
    return out


@dataclass(slots=True)
class QATHandle:
    """The fake quantization installed by `apply_int4_qat`.

    Attributes:
        targets: full names of the fake-quantized parameters.
        patterns: the patterns that selected them.
        group: the INT4 group size.
    """

    targets: list[str]
    patterns: tuple[str, ...]
    group: int
    _hooks: list[Any] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Uninstall the fake quantization (the model computes with plain weights again)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


_INSTALLED = "_miles_int4_qat"


def apply_int4_qat(
    model: torch.nn.Module,
    *,
    patterns: Sequence[str] = DEFAULT_QAT_PATTERNS,
    group: int = 128,
    scale_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> QATHandle:
    """Fake-quantize, in every forward, the parameters of ``model`` selected by ``patterns``.

    Selected: floating-point parameters with at least 2 dims whose full name matches a
    pattern (globs on the parameter or a containing module's name, or "re:" + a regex, as in
    `miles_quant.checkpoint`). The default, ``*.experts.*``, takes MoE expert weights, both
    per-expert Linear weights (``mlp.experts.3.down_proj.weight``) and fused expert parameters
    (transformers' Qwen3-MoE ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I]; groups along their last, input, dim). Parameter names, the state dict and the
    optimizer are unchanged: the module's forward sees ``fake_quantize_int4(param)`` in place
    of ``param`` (a forward pre-hook swaps it in, a forward hook swaps the parameter back, also
    when the forward raises). This works under FSDP2 (the hook sees the unsharded parameter)
    and ``torch.func.functional_call`` (it sees the swapped-in tensor, e.g. a bf16 copy).

    Args:
        model: the model to train.
        patterns: which parameters to fake-quantize.
        group: INT4 group size along the last dim, 32 or 128.
        scale_dtype: scale storage dtype (default: each weight's compute dtype).
        backend: quantize backend.

    Returns:
        A QATHandle (``remove()`` undoes it).

    Raises:
        ValueError: a bad group or pattern, no parameter matched, a selected parameter whose
            last dim is not a multiple of ``group`` (compressed-tensors cannot store it), or
            QAT already applied to the model.
    """
    fmt = _check_group(group)
    check_pattern_list(patterns, "apply_int4_qat: patterns")
    pats = tuple(patterns)
    if not pats:
        raise ValueError("apply_int4_qat: patterns must name at least one pattern")
    for p in pats:
        _check_pattern(p)
    if getattr(model, _INSTALLED, False):
        raise ValueError("apply_int4_qat: QAT is already applied to this model; remove() it first")
    per_module: dict[torch.nn.Module, list[str]] = {}
    targets: list[str] = []
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if not (p.is_floating_point() and p.dim() >= 2 and any(matches(full, x) for x in pats)):
                continue
            if p.shape[-1] % group:
                raise ValueError(
                    f"apply_int4_qat: {full} has shape {tuple(p.shape)}; its last dim must be a "
                    f"multiple of the group ({group}) for a compressed-tensors export"
                )
            per_module.setdefault(mod, []).append(p_name)
            targets.append(full)
    if not targets:
        sample = [n for n, p in model.named_parameters() if p.dim() >= 2][:5]
        raise ValueError(
            f"apply_int4_qat: no parameter matches {list(pats)} (parameters look like {sample})"
        )
    handle = QATHandle(targets, pats, group)
    for mod, names in per_module.items():
        handle._hooks.extend(_install(mod, names, fmt, scale_dtype, backend))

    def _unmark() -> None:
        object.__setattr__(model, _INSTALLED, False)

    object.__setattr__(model, _INSTALLED, True)
    handle._hooks.append(_Callback(_unmark))
    return handle


@dataclass(slots=True)
class _Callback:
    fn: Any

    def remove(self) -> None:
        self.fn()


def _install(
    mod: torch.nn.Module,
    names: list[str],
    fmt: str,
    scale_dtype: torch.dtype | None,
    backend: Backend,
) -> list[Any]:
    saved: list[dict[str, Any]] = []  # a stack: a module may be re-entered

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        frame = {n: module._parameters[n] for n in names}
        fake = {n: _FakeQuantInt4.apply(t, fmt, scale_dtype, backend) for n, t in frame.items()}
        saved.append(frame)  # before swapping: the forward hook always restores this frame
        for n, t in fake.items():
            module._parameters[n] = t

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not saved:
            return
        for n, t in saved.pop().items():
            module._parameters[n] = t

    return [
        mod.register_forward_pre_hook(pre_hook),
        mod.register_forward_hook(post_hook, always_call=True),
    ]
