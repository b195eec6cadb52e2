"""INT4 quantization-aware training of the policy, through miles-quant (an optional extra).

miles-quant is imported only when a `QATConfig` is given, so miles-trainer works without it.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_trainer._config import QATConfig

__all__ = ["apply_qat"]


def apply_qat(model: torch.nn.Module, config: QATConfig) -> Any:
    """Install INT4 fake quantization (straight-through gradient) on ``model``'s selected weights.

    Returns:
        miles-quant's ``QATHandle`` (``targets`` lists the fake-quantized parameters).

    Raises:
        ImportError: miles-quant is not installed.
        ValueError: no parameter matches ``config.patterns``, or one cannot be grouped.
    """
    try:
        from miles_quant.qat import apply_int4_qat
    except ImportError as e:
        raise ImportError(
            "TrainerConfig.qat needs miles-quant: pip install miles-quant "
            "(or pip install 'miles-trainer[quant]')"
        ) from e
    return apply_int4_qat(model, patterns=config.patterns, group=config.group)
