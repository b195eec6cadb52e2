"""In-process transport: ranks are threads of one process (tests, colocated trainer and engine).

A receiver posts its buffer and waits; the sender copies straight into the posted buffer (one
copy, like an RDMA write into registered memory) and wakes it. Works for CPU and CUDA buffers.
"""

from __future__ import annotations

import queue
import threading

import torch

from miles_transfer.p2p.transports.base import TransportError, check_buffer

__all__ = ["InProcessHub", "InProcessTransport"]


class _Posted:
    __slots__ = ("buf", "cancelled", "done", "error", "lock")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.cancelled = False  # the receiver gave up: a later send must not write here
        self.error: str | None = None


class InProcessHub:
    """The meeting point of one group's in-process endpoints; `transport(rank)` makes one.

    Args:
        world_size: ranks in the group.
        timeout: seconds a send or recv waits for its peer before TransportError.
    """

    def __init__(self, world_size: int, *, timeout: float = 300.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout = world_size, timeout
        self._posted: dict[tuple[int, int], queue.Queue[_Posted]] = {
            (a, b): queue.Queue() for a in range(world_size) for b in range(world_size)
        }

    def transport(self, rank: int) -> InProcessTransport:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a group of {self.world_size}")
        return InProcessTransport(self, rank)

    def posted(self, src: int, dst: int) -> queue.Queue[_Posted]:
        q = self._posted.get((src, dst))
        if q is None:
            raise ValueError(f"ranks {src} -> {dst} outside a group of {self.world_size}")
        return q


class InProcessTransport:
    """One rank's endpoint on an InProcessHub (see the module docstring)."""

    def __init__(self, hub: InProcessHub, rank: int) -> None:
        self._hub, self._rank = hub, rank

    @property
    def rank(self) -> int:
        return self._rank

    def send(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf, cpu=False)
        q = self._hub.posted(self._rank, peer)
        while True:
            try:
                post = q.get(timeout=self._hub.timeout)
            except queue.Empty:
                raise TransportError(
                    f"rank {peer} posted no receive for rank {self._rank} in time"
                ) from None
            with post.lock:
                if post.cancelled:
                    continue
                if post.buf.numel() != buf.numel():
                    post.error = (
                        f"rank {self._rank} sent {buf.numel()} bytes, rank {peer} expected "
                        f"{post.buf.numel()}"
                    )
                    post.done.set()
                    raise TransportError(post.error)
                post.buf.copy_(buf)
                if buf.device.type == "cuda" or post.buf.device.type == "cuda":
                    torch.cuda.synchronize()
                post.done.set()
                return

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf, cpu=False)
        post = _Posted(buf)
        self._hub.posted(peer, self._rank).put(post)
        if not post.done.wait(self._hub.timeout):
            with post.lock:
                if not post.done.is_set():
                    post.cancelled = True
                    raise TransportError(
                        f"rank {self._rank}: nothing from rank {peer} within {self._hub.timeout} s"
                    )
        if post.error is not None:
            raise TransportError(post.error)

    def close(self) -> None:
        pass
