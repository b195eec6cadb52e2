"""FSDP2 checkpoints: gather the full HF-named weights of a sharded (or plain) module."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

__all__ = ["gather_full_state_dict"]


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model`` on rank 0, ``{}`` elsewhere. Collective.

    Tied parameters appear once, under their first name (as ``save_pretrained`` writes them);
    non-persistent buffers are left out.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts)
    if not full:
        return {}
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    first_names = {n for n, _ in model.named_parameters()}
    tied = all_names - first_names
    out: dict[str, torch.Tensor] = {}
    for k, v in full.items():
        assert isinstance(v, torch.Tensor), f"{k}: expected a tensor, got {type(v).__name__}"
        if k not in tied:
            out[k] = v
    return out
