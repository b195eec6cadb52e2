"""The transport interface of P2P weight transfer, and the socket mesh several transports share.

A transfer group numbers its ranks 0..N-1 (trainer ranks first, then rollout ranks; see
`miles_transfer._p2p`). A `Transport` is one rank's endpoint: it moves a byte buffer to a peer
and receives one from a peer. Messages between two ranks arrive in the order they were sent;
both ends know every message's size from the transfer plan, so no headers travel with the data.
`send` to different peers and `recv` from different peers may run concurrently in different
threads; calls for one (direction, peer) are sequential.

`SocketMesh` is the control (and for TCP, data) plane of the socket-based transports: every rank
listens on an ephemeral port, publishes `host:port` in a `torch.distributed.Store` (a TCPStore:
torch only, no extra service), and a sender opens one connection per receiver on first use.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
from typing import Protocol, runtime_checkable

import torch

__all__ = ["SocketMesh", "Store", "Transport", "TransportError", "writable_view"]


class TransportError(RuntimeError):
    """A transport failed to move a message (peer gone, timeout, size mismatch)."""


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
    """The part of a `torch.distributed.Store` (TCPStore, FileStore, ...) the mesh uses."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str]) -> None: ...


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


_HELLO = struct.Struct("<q")
_SOCK_BUF = 8 << 20


class SocketMesh:
    """Per-peer TCP connections, found through a Store (see the module docstring).

    Args:
        store: a torch.distributed Store shared by the group (e.g. `dist.TCPStore`).
        rank: this rank in the transfer group.
        host: address to listen on and publish (loopback by default).
        prefix: key prefix in the store (use one per group sharing a store).
        timeout: seconds any blocking operation may take before TransportError.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        *,
        host: str = "127.0.0.1",
        prefix: str = "miles-p2p",
        timeout: float = 300.0,
    ) -> None:
        self._rank, self._store, self._prefix, self._timeout = rank, store, prefix, timeout
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.5)
        self._out: dict[int, socket.socket] = {}
        self._in: dict[int, socket.socket] = {}
        self._cv = threading.Condition()
        self._closed = False
        port = self._listener.getsockname()[1]
        store.set(f"{prefix}/addr/{rank}", f"{host}:{port}")
        self._acceptor = threading.Thread(
            target=self._accept, name=f"p2p-accept-{rank}", daemon=True
        )
        self._acceptor.start()

    @property
    def rank(self) -> int:
        return self._rank

    def _tune(self, s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
        s.settimeout(self._timeout)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._tune(conn)
            try:
                (peer,) = _HELLO.unpack(recv_bytes(conn, _HELLO.size))
            except (OSError, TransportError):
                conn.close()
                continue
            with self._cv:
                self._in[peer] = conn
                self._cv.notify_all()

    def out_conn(self, peer: int) -> socket.socket:
        """The connection this rank sends to peer on (opened on first use)."""
        s = self._out.get(peer)
        if s is None:
            key = f"{self._prefix}/addr/{peer}"
            self._store.wait([key])
            host, port = self._store.get(key).decode().rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=self._timeout)
            self._tune(s)
            s.sendall(_HELLO.pack(self._rank))
            self._out[peer] = s
        return s

    def in_conn(self, peer: int) -> socket.socket:
        """The connection peer sends to this rank on (waits for peer to open it)."""
        with self._cv:
            if not self._cv.wait_for(lambda: peer in self._in or self._closed, self._timeout):
                raise TransportError(
                    f"rank {self._rank}: no connection from rank {peer} within {self._timeout} s"
                )
            if self._closed:
                raise TransportError("transport closed")
            return self._in[peer]

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._cv:
            self._cv.notify_all()
            for s in (*self._out.values(), *self._in.values()):
                s.close()
            self._out.clear()
            self._in.clear()
        self._acceptor.join(timeout=2)
