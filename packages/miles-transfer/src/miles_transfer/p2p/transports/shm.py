"""Shared memory (same host; sockets carry only control messages).

`ShmTransport` copies each message into a per-(sender, receiver) segment in /dev/shm and sends
only a small header (size and segment name) over the socket; the receiver copies out and acks,
after which the sender may reuse the segment. A segment grows when a bigger message comes (a new
file); the sender unlinks each file as soon as the receiver acknowledged mapping it, so nothing
is left in /dev/shm even if a process dies later.
"""

from __future__ import annotations

import os
import struct
import uuid

import torch

from miles_transfer.p2p.transports.base import Store, TransportError, check_buffer, recv_bytes
from miles_transfer.p2p.transports.socket import SocketMesh

__all__ = ["ShmTransport"]


_HDR = struct.Struct("<qH")  # message bytes, segment-name length (0: same segment as before)
_ACK = b"\x01"


class ShmTransport(SocketMesh):
    """Same-host messages through /dev/shm segments (see the module docstring).

    Args: as SocketMesh, plus `shm_dir` (default /dev/shm).
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
        shm_dir: str = "/dev/shm",
    ) -> None:
        super().__init__(
            store,
            rank,
            host=host,
            prefix=prefix,
            timeout=timeout,
            api_key=api_key,
            insecure_no_auth=insecure_no_auth,
        )
        self._dir = shm_dir
        self._tag = uuid.uuid4().hex[:12]
        self._out_seg: dict[int, torch.Tensor] = {}
        self._in_seg: dict[int, torch.Tensor] = {}

    def send(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf)
        n = buf.numel()
        seg = self._out_seg.get(peer)
        name = b""
        path = ""
        if seg is None or seg.numel() < n:
            cap = max(n, 1 << 20, 0 if seg is None else 2 * seg.numel())
            path = os.path.join(self._dir, f"miles-p2p-{self._tag}-{self.rank}-{peer}-{cap}")
            seg = torch.from_file(path, shared=True, size=cap, dtype=torch.uint8)
            self._out_seg[peer] = seg
            name = path.encode()
        try:
            seg[:n].copy_(buf)
            conn = self.out_conn(peer)
            conn.sendall(_HDR.pack(n, len(name)) + name)
            if recv_bytes(conn, 1) != _ACK:
                raise TransportError(f"rank {peer} sent a bad acknowledgement")
        except OSError as exc:
            raise TransportError(f"rank {self.rank} -> {peer}: {exc}") from exc
        finally:
            if path:
                os.unlink(path)  # the receiver has mapped it (or failed): the name is not needed

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf)
        try:
            conn = self.in_conn(peer)
            n, name_len = _HDR.unpack(recv_bytes(conn, _HDR.size))
            if name_len:
                path = recv_bytes(conn, name_len).decode()
                size = os.path.getsize(path)
                self._in_seg[peer] = torch.from_file(
                    path, shared=True, size=size, dtype=torch.uint8
                )
            seg = self._in_seg.get(peer)
            if seg is None or n != buf.numel():
                raise TransportError(
                    f"rank {peer} sent {n} bytes, rank {self.rank} expected {buf.numel()}"
                )
            buf.copy_(seg[:n])
            conn.sendall(_ACK)
        except OSError as exc:
            raise TransportError(f"rank {peer} -> {self.rank}: {exc}") from exc

    def close(self) -> None:
        self._out_seg.clear()
        self._in_seg.clear()
        super().close()
