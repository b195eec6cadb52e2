"""P2P helpers for plain and FSDP2 torch modules (trainer side) and in-process engines.

- `module_param_specs(module)`: HF name -> ParamSpec of every state_dict entry, with the full
  (global) shape of FSDP2 DTensors; feed it to `fsdp_layout` / `replicated_layout`.
- `module_shards(module)`: HF name -> this rank's local tensor (a DTensor's local shard, as
  FSDP2's Shard(0) placement holds it; a plain tensor whole). No collective: each trainer rank
  sends its own shard, nobody gathers.
- `tied_names(module)`: the names that alias an earlier entry (tied embeddings), to leave out.
- `module_buffers(module)`: HF name -> the module's own parameter and buffer storage, to receive
  straight into an in-process engine's weights (a TP 1 engine's layout is
  `replicated_layout(module_param_specs(engine_model))`).

Names drop the wrapper segments `iter_full_state` drops, so both sides speak HF names.
"""

from __future__ import annotations

import torch

from miles_transfer.p2p.layouts.base import ParamSpec
from miles_transfer.push.state import _hf_name, _is_dtensor

__all__ = ["module_buffers", "module_param_specs", "module_shards", "tied_names"]


def module_param_specs(module: torch.nn.Module) -> dict[str, ParamSpec]:
    """Full shape and dtype of every state_dict entry, by HF name."""
    return {_hf_name(n): ParamSpec(tuple(t.shape), t.dtype) for n, t in module.state_dict().items()}


def module_shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local part of every state_dict entry (see the module docstring).

    Raises:
        ValueError: a DTensor is not sharded along dim 0 alone (the FSDP2 layout) or replicated.
    """
    out: dict[str, torch.Tensor] = {}
    for n, t in module.state_dict().items():
        if _is_dtensor(t):
            places = [type(p).__name__ + str(getattr(p, "dim", "")) for p in t.placements]
            if any(p not in ("Shard0", "Replicate") for p in places):
                raise ValueError(
                    f"{_hf_name(n)!r} has placements {places}; module_shards handles FSDP2's "
                    "Shard(0) only (describe other layouts with Layout pieces and pass the local "
                    "tensors yourself)"
                )
            t = t.to_local()
        out[_hf_name(n)] = t.detach().contiguous()
    return out


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameter/buffer tensors (writes land in the module), by HF name.

    Raises:
        ValueError: a tensor is not contiguous (it could not be written in place).
    """
    out: dict[str, torch.Tensor] = {}
    for n, t in module.state_dict(keep_vars=True).items():
        data = t.data if isinstance(t, torch.nn.Parameter) else t
        if _is_dtensor(data):
            raise ValueError(f"{_hf_name(n)!r} is a DTensor; use module_shards on trainer ranks")
        if not data.is_contiguous():
            raise ValueError(f"{_hf_name(n)!r} is not contiguous; call .contiguous() on the model")
        out[_hf_name(n)] = data
    return out


def tied_names(module: torch.nn.Module) -> set[str]:
    """HF names of state_dict entries that are the same parameter as an earlier entry (tied
    embeddings: ``lm_head.weight``); moving them again would move the same bytes twice."""
    seen: set[int] = set()
    out: set[str] = set()
    for n, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            out.add(_hf_name(n))
        seen.add(id(t))
    return out
