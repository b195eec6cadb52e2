"""The protocol every weight receiver (engine) implements."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["WeightReceiver"]


@runtime_checkable
class WeightReceiver(Protocol):
    """Something that serves a model and can take new weights: an engine or a plain module.

    ``dtype`` is the precision the receiver serves; senders cast to it before sending and before
    computing digests, so digests compare what the receiver really holds.
    """

    dtype: torch.dtype

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Copy the given tensors into the served weights (HF names). Unknown names raise."""
        ...

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Return ``{name: tensor_digest(weight)}`` for the given names (all when ``None``)."""
        ...
