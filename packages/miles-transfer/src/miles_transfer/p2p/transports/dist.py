"""torch.distributed transport: point-to-point send/recv in a process group (gloo, NCCL).

The transfer group's ranks map to process-group ranks through `ranks` (identity by default).
With gloo, buffers are CPU tensors; with NCCL, CUDA tensors (stage on the GPU: the P2P sender
and receiver allocate their staging buffers on the device of the shards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from miles_transfer.p2p.transports.base import TransportError, check_buffer

__all__ = ["TorchDistributedTransport"]


class TorchDistributedTransport:
    """Send/recv over an initialized torch.distributed process group.

    Args:
        rank: this process's rank in the transfer group.
        ranks: process-group rank of each transfer-group rank (default: the same numbers).
        group: the process group (default: the global group).
    """

    def __init__(
        self,
        rank: int,
        *,
        ranks: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "TorchDistributedTransport needs torch.distributed.init_process_group() first"
            )
        self._rank, self._ranks, self._group = (
            rank,
            list(ranks) if ranks is not None else None,
            group,
        )

    @property
    def rank(self) -> int:
        return self._rank

    def _global(self, peer: int) -> int:
        if self._ranks is None:
            return peer
        if not 0 <= peer < len(self._ranks):
            raise ValueError(f"peer {peer} outside the transfer group of {len(self._ranks)} ranks")
        return self._ranks[peer]

    def send(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf, cpu=False)
        try:
            dist.send(buf, dst=self._global(peer), group=self._group)
        except RuntimeError as exc:
            raise TransportError(f"rank {self._rank} -> {peer}: {exc}") from exc

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf, cpu=False)
        try:
            dist.recv(buf, src=self._global(peer), group=self._group)
        except RuntimeError as exc:
            raise TransportError(f"rank {peer} -> {self._rank}: {exc}") from exc

    def close(self) -> None:
        pass
