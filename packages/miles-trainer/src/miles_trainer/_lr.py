"""Setting the scheduled learning rate on an optimizer (torch, miles-offload or megatron-core)."""

from __future__ import annotations

from typing import Any

__all__ = ["set_lr"]


def set_lr(optimizer: Any, lr: float) -> None:
    """Give every parameter group of ``optimizer`` the learning rate ``lr`` for its next step.

    torch's AdamW, miles-offload's AdamW and megatron-core's optimizers (their ``param_groups``
    are the wrapped optimizer's) all read ``group["lr"]`` at each step; a group's ``lr_mult``
    (megatron-core's per-group factor) is kept.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
