"""The FSDP2 backend's AdamW: torch's, or miles-offload's with the state in CPU memory or on NVMe.

miles-offload is optional (``pip install miles-trainer[offload]``) and imported only when
``TrainerConfig.offload.mode`` asks for it (`OffloadConfig.build`). Its AdamW is torch's
single-tensor AdamW op for op, and the foreach AdamW here gives the same bits, so every offload
mode trains identically.
"""

from __future__ import annotations

import torch

from miles_trainer.config import TrainerConfig

__all__ = ["build_optimizer"]


def build_optimizer(
    params: list[torch.nn.Parameter], config: TrainerConfig, rank: int
) -> torch.optim.Optimizer:
    """AdamW over ``params`` per ``config`` (lr, betas, eps, weight decay, offload).

    Raises:
        ImportError: offload is on and miles-offload is not installed.
    """
    if config.offload.mode != "none":  # the same update, state in CPU memory or on NVMe
        optimizer: torch.optim.Optimizer = config.offload.build(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            rank=rank,
        )
        return optimizer
    # foreach: one op per tensor list instead of per tensor; on plain tensors and on DTensors
    # (CPU gloo included) it gives the same bits as the per-tensor loop.
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=True,
        fused=False,
    )
