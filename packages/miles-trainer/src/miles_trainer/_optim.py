"""The trainer's AdamW: torch's, or miles-offload's with the state in CPU memory or on NVMe.

miles-offload is optional (``pip install miles-trainer[offload]``) and imported only when
``TrainerConfig.offload`` asks for it. Its AdamW is torch's single-tensor AdamW op for op, and
the trainer's foreach AdamW gives the same bits, so every offload mode trains identically.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from miles_trainer._config import TrainerConfig

__all__ = ["build_offload_optimizer"]


def build_offload_optimizer(
    params: Iterable[torch.nn.Parameter], config: TrainerConfig, rank: int
) -> torch.optim.Optimizer:
    """miles_offload.AdamW for ``config.offload`` in ("cpu", "nvme"); rank r's NVMe state goes
    to ``<offload_path>/rank<r>``.

    Raises:
        ImportError: miles-offload is not installed (the message names the pip command).
    """
    assert config.offload in ("cpu", "nvme"), config.offload
    try:
        import miles_offload  # pants: no-infer-dep (optional extra; tests depend on its wheel)
    except ImportError as exc:
        raise ImportError(
            f'TrainerConfig.offload = "{config.offload}" needs the miles-offload package: '
            "pip install miles-offload (or pip install 'miles-trainer[offload]')"
        ) from exc
    path = None
    if config.offload == "nvme":
        assert config.offload_path is not None
        path = os.path.join(config.offload_path, f"rank{rank}")
    return miles_offload.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        offload=config.offload,
        path=path,
        bucket_mb=config.offload_bucket_mb,
    )
