"""The contracts between miles-transfer and the things it talks to.

- ``WeightReceiver``: an engine (or plain module) that takes new weights by HF name and reports
  per-tensor digests; what ``push_weights`` sends to.
- ``PausableEngine`` / ``DiskReloadEngine``: an engine that pauses generation around a swap and
  takes tensors / reloads a checkpoint directory (SGLang's API); what the disk-delta engine
  update drives.
- ``Transport`` (and the ``Store`` its socket transports rendezvous through): one rank's
  endpoint of a P2P transfer group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["DiskReloadEngine", "PausableEngine", "Store", "Transport", "WeightReceiver"]


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


class PausableEngine(Protocol):
    """An engine that takes tensors by HF name and can pause generation (SGLang's API)."""

    def pause_generation(self, mode: str = ...) -> None: ...

    def continue_generation(self) -> None: ...

    def update_weights_from_tensor(
        self,
        named_tensors: Any,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None: ...


class DiskReloadEngine(Protocol):
    """An engine that reloads its weights from a checkpoint directory (SGLang's API)."""

    def pause_generation(self, mode: str = ...) -> None: ...

    def continue_generation(self) -> None: ...

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None
    ) -> Any: ...


@runtime_checkable
class Transport(Protocol):
    """One rank's endpoint for moving byte buffers (1-D contiguous uint8 tensors)."""

    @property
    def rank(self) -> int: ...

    def send(self, peer: int, buf: torch.Tensor) -> None:
        """Send buf to peer; returns once buf may be reused."""
        ...

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        """Receive the next message from peer into buf (exactly buf's size)."""
        ...

    def close(self) -> None:
        """Release sockets, shared memory and registrations."""
        ...


class Store(Protocol):
    """The part of a `torch.distributed.Store` (TCPStore, FileStore, ...) the socket mesh uses."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str]) -> None: ...

    def check(self, keys: list[str]) -> bool: ...
