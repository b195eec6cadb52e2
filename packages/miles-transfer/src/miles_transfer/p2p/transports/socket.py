"""TCP: the socket mesh the socket-based transports share, and the TCP transport (any hosts).

`SocketMesh` is the control (and for TCP, data) plane of the socket-based transports: every rank
listens on an ephemeral port, publishes `host:port` in a `torch.distributed.Store` (a TCPStore:
torch only, no extra service), and a sender opens one connection per receiver on first use.

`TcpTransport` streams each message over the sender's connection to the receiver (`sendall` /
`recv_into` on the tensors' memory, no intermediate copies in Python).

With ``api_key`` every connection proves the key both ways and every Store value is signed
(``transports/auth.py``); without one, a non-loopback ``host`` refuses to start unless
``insecure_no_auth``.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading

import torch

from miles_transfer.auth import check_bind
from miles_transfer.p2p.transports.auth import SignedStore, accept_handshake, connect_handshake
from miles_transfer.p2p.transports.base import (
    Store,
    TransportError,
    check_buffer,
    recv_bytes,
    recv_exact,
    writable_view,
)

__all__ = ["SocketMesh", "TcpTransport"]

logger = logging.getLogger(__name__)
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
        api_key: every peer must prove it (HMAC challenge) and Store values are signed.
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.

    Raises:
        ValueError: a non-loopback ``host`` without ``api_key`` or ``insecure_no_auth``.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        *,
        host: str = "127.0.0.1",
        prefix: str = "miles-p2p",
        timeout: float = 300.0,
        api_key: str | None = None,
        insecure_no_auth: bool = False,
    ) -> None:
        check_bind(host, api_key, insecure_no_auth=insecure_no_auth, what="the P2P mesh")
        self._key = api_key.encode() if api_key else None
        if api_key and not isinstance(store, SignedStore):
            store = SignedStore(store, api_key)
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
                if self._key is not None:
                    peer = accept_handshake(conn, self._key)
                else:
                    (peer,) = _HELLO.unpack(recv_bytes(conn, _HELLO.size))
            except (OSError, TransportError, struct.error) as exc:
                logger.warning("p2p rank %d: refused a connection (%s)", self._rank, exc)
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
            try:
                if self._key is not None:
                    connect_handshake(s, self._rank, self._key)
                else:
                    s.sendall(_HELLO.pack(self._rank))
            except BaseException:
                s.close()
                raise
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


class TcpTransport(SocketMesh):
    """Messages over TCP connections found through a Store (see SocketMesh for the arguments)."""

    def send(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf)
        try:
            self.out_conn(peer).sendall(writable_view(buf))
        except OSError as exc:
            raise TransportError(f"rank {self.rank} -> {peer}: {exc}") from exc

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf)
        try:
            recv_exact(self.in_conn(peer), writable_view(buf))
        except OSError as exc:
            raise TransportError(f"rank {peer} -> {self.rank}: {exc}") from exc
