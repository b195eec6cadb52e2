"""Calibration of fused MoE experts: the inputs of each expert's GEMMs.

transformers 5 keeps the experts of Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE and kin fused in
one module (``mlp.experts``) with 3-D parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I], not as Linear modules, while the checkpoint engines load names them per expert
(``mlp.experts.{e}.{gate,up,down}_proj``). The experts' eager forward calls
``F.linear(x, gate_up_proj[e])`` and ``F.linear(h, down_proj[e])`` per expert; a torch function
mode sees those calls and recognises each expert by the address of its weight slice, so the
amax of every expert's inputs is recorded under the per-expert module names.

During calibration the model's experts run their eager loop (``config._experts_implementation
= "eager"``, restored afterwards): the fused grouped-GEMM paths make no per-expert call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ExpertSpy", "eager_experts", "fused_expert_slices"]

Record = Callable[[str, torch.Tensor], None]


def fused_expert_slices(
    model: torch.nn.Module, selected: Callable[[str], bool]
) -> dict[int, tuple[tuple[int, ...], list[str]]]:
    """Address of every expert's weight slice -> (its shape, the module names it feeds).

    ``gate_up_proj[e]`` feeds ``<experts>.{e}.gate_proj`` and ``<experts>.{e}.up_proj`` (one
    input); ``down_proj[e]`` feeds ``<experts>.{e}.down_proj``. Only names that ``selected``
    accepts are kept.
    """
    out: dict[int, tuple[tuple[int, ...], list[str]]] = {}
    for name, mod in model.named_modules():
        params = dict(mod.named_parameters(recurse=False))
        gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
        if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
            continue
        for e in range(gate_up.shape[0]):
            for p, leaves in ((gate_up, ("gate", "up")), (down, ("down",))):
                names = [f"{name}.{e}.{leaf}_proj" for leaf in leaves]
                names = [n for n in names if selected(n)]
                if names:
                    out[p[e].data_ptr()] = (tuple(p[e].shape), names)
    return out


class ExpertSpy(TorchFunctionMode):
    """Records the input of every ``F.linear`` whose weight is one of the expert slices."""

    def __init__(self, slices: dict[int, tuple[tuple[int, ...], list[str]]], record: Record):
        super().__init__()
        self.slices = slices
        self.record = record

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(w, torch.Tensor) and isinstance(x, torch.Tensor):
                hit = self.slices.get(w.data_ptr())
                if hit is not None and tuple(w.shape) == hit[0]:
                    for n in hit[1]:
                        self.record(n, x)
        return func(*args, **kwargs)


@contextmanager
def eager_experts(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's fused experts with their eager per-expert loop, then restore."""
    config = getattr(model, "config", None)
    before = getattr(config, "_experts_implementation", None)
    switch = config is not None and before not in (None, "eager")
    if switch:
        config._experts_implementation = "eager"  # type: ignore[union-attr]
    try:
        yield
    finally:
        if switch:
            config._experts_implementation = before  # type: ignore[union-attr]
