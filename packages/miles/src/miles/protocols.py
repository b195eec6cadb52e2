"""The loop's three boundaries: a trainer, a rollout source and a weight sync.

The loop (``miles.loop.train``) only calls these. The synchronous and the asynchronous rollout
are two ``RolloutSource`` implementations, each trainer backend is a ``Trainer``, each transfer
method a ``WeightSync``; adding one is a new class, not an edit of the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from miles_rollout import Sample

__all__ = ["RolloutBatch", "RolloutSource", "Trainer", "WeightSync"]


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """What a rollout source hands the loop for one trainer step.

    Attributes:
        groups: graded groups of samples (one group per prompt), in the order to train them.
        metrics: the source's numbers for this step (logged under ``rollout/``).
        seconds: how long the loop waited for this batch.
    """

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class Trainer(Protocol):
    """A policy trainer (FSDP2 or Megatron). Every rank calls ``train_step`` with the same batch."""

    @property
    def rank(self) -> int:
        """This process's rank (0 owns the rollout and the run directory)."""
        ...

    @property
    def world_size(self) -> int:
        """How many trainer processes there are."""
        ...

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        """One optimizer step on ``batch``; return its metrics (logged under ``train/``)."""
        ...

    def save_hf_checkpoint(self, path: Path) -> None:
        """Write the policy as a Hugging Face checkpoint (a collective on every rank)."""
        ...

    def save_checkpoint(self, path: Path, *, step: int, client_state: Any = None) -> None:
        """Write the whole training state and rank 0's ``client_state`` atomically
        (collective)."""
        ...

    def load_checkpoint(self, path: Path) -> Any:
        """Restore what ``save_checkpoint`` wrote; return an object with ``step`` and
        ``client_state`` (collective)."""
        ...


class RolloutSource(Protocol):
    """Where trainable groups come from (rank 0 only)."""

    def next_batch(self, step: int) -> RolloutBatch:
        """Block until the groups for trainer step ``step`` (1-based) are ready."""
        ...

    def weights_updated(self, version: int) -> None:
        """The engines now serve the trainer's weights after ``version`` steps."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs from the source (e.g. buffered groups)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` before the first ``next_batch``."""
        ...

    def close(self) -> None:
        """Stop generating and release engines and threads (idempotent)."""
        ...


class WeightSync(Protocol):
    """Moves the trainer's weights to the engines after a step (a collective on every rank)."""

    def sync(self, trainer: Trainer, version: int) -> Mapping[str, Any]:
        """Make the engines serve the trainer's weights as ``version``; return what it did
        (logged under ``update/``: bytes moved, pause, verification)."""
        ...
