"""What every P2P transport shares: its error, buffer checks and exact socket reads.

A transfer group numbers its ranks 0..N-1 (trainer ranks first, then rollout ranks; see
`miles_transfer.p2p.transfer`). A `Transport` (`miles_transfer.protocols.Transport`) is one
rank's endpoint: it moves a byte buffer to a peer and receives one from a peer. Messages between
two ranks arrive in the order they were sent; both ends know every message's size from the
transfer plan, so no headers travel with the data. `send` to different peers and `recv` from
different peers may run concurrently in different threads; calls for one (direction, peer) are
sequential.
"""

from __future__ import annotations

import ctypes
import socket

import torch

from miles_transfer.protocols import Store, Transport

__all__ = [
    "Store",
    "Transport",
    "TransportError",
    "check_buffer",
    "recv_bytes",
    "recv_exact",
    "writable_view",
]


class TransportError(RuntimeError):
    """A transport failed to move a message (peer gone, timeout, size mismatch)."""


def writable_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview aliasing a contiguous CPU tensor (no numpy needed)."""
    assert t.device.type == "cpu", t.device
    assert t.is_contiguous(), t.stride()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def check_buffer(buf: torch.Tensor, *, cpu: bool = True) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"transport buffers are 1-D contiguous uint8 tensors, got {buf.dtype}{list(buf.shape)}"
        )
    if cpu and buf.device.type != "cpu":
        raise ValueError(f"this transport moves CPU buffers, got one on {buf.device}")


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransportError("peer closed the connection in the middle of a message")
        got += n


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)
