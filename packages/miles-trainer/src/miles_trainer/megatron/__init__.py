"""The Megatron-core backend: `MegatronTrainer` (``megatron/trainer.py``) and its layout,
conversion, checkpoint and optimizer pieces.

Importing this package stays light (no megatron-core): `MegatronConfig` validates a recipe
without the optional dependency; ``MegatronTrainer`` imports megatron-core on first access
(``pip install 'miles-trainer[megatron]'``).
"""

from __future__ import annotations

from typing import Any

from miles_trainer.megatron.config import MegatronConfig

__all__ = ["MegatronConfig", "MegatronTrainer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTrainer":
        from miles_trainer.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
