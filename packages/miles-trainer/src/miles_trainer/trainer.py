"""`Trainer`: the contract every backend implements (``fsdp/trainer.py``, ``megatron/trainer.py``).

The loop talks to a trainer only through these methods, so ``trainer.backend`` in a recipe
changes the backend without touching the loop. Every method is collective: all ranks call it
with the same arguments.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch

from miles_trainer.batch import TrainBatch
from miles_trainer.checkpoint import CheckpointInfo

__all__ = ["NonFiniteError", "Trainer"]


@runtime_checkable
class Trainer(Protocol):
    """A policy trainer: takes a `TrainBatch`, updates the policy, exposes HF-named weights."""

    @property
    def model(self) -> torch.nn.Module:
        """The policy with fp32 master weights; ``state_dict()`` keys are HF names (sharded
        values on several ranks)."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on ``batch``; metrics identical on every rank."""
        ...

    def compute_logprobs(
        self, tokens: list[list[int]], response_lengths: list[int]
    ) -> list[list[float]]:
        """Teacher-forced response logprobs of the current policy (the rollout contract)."""
        ...

    def save_hf_checkpoint(self, path: str | os.PathLike[str], *, dtype: str | None = None) -> None:
        """Write an HF model directory of the policy (rank 0 writes; collective)."""
        ...

    def save_checkpoint(
        self, path: str | os.PathLike[str], *, step: int, client_state: Any = None
    ) -> None:
        """Write the whole training state (model, optimizer, critic, every rank's RNG states,
        ``step``, rank 0's ``client_state``) to the directory ``path``, atomically."""
        ...

    def load_checkpoint(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Restore what `save_checkpoint` wrote (same model and layout); return its step and
        client state. Raises `miles_trainer.checkpoint.CheckpointError` for a torn or foreign
        checkpoint."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for resuming."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with ``TrainerConfig.on_nonfinite = "stop"``.

    Raised before the optimizer step: the weights and the optimizer state are untouched.
    """
