"""When a fused op must step aside: forward hooks that expect the modules' own forwards."""

from __future__ import annotations

import torch
from torch.nn.modules import module as nn_module

__all__ = ["hooked"]


def hooked(*modules: torch.nn.Module | None) -> bool:
    """Whether a global forward hook exists or any of ``modules`` has one (QAT's fake
    quantisation swaps a projection's weight in a pre-hook): the fused ops read the weights
    directly and would bypass it, so the HF forward runs instead."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in modules)
