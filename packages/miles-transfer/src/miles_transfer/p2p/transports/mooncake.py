"""Mooncake transport: RDMA writes through Mooncake's transfer engine (TCP where no RDMA).

Optional extra: `pip install "miles-transfer[mooncake]"` (mooncake-transfer-engine-non-cuda; on a
GPU cluster install mooncake-transfer-engine). Each rank runs one TransferEngine in P2P handshake
mode (no metadata server) and publishes its RPC address in the group's Store. The data moves
as a one-sided write into the receiver's memory, the way RDMA is used:

1. the receiver registers its buffer (once per storage; the P2P receiver reuses its staging
   buffers; a registration whose memory was freed and reused is replaced) and sends its
   address and size to the sender over the socket mesh;
2. the sender writes its (registered) buffer there with `transfer_sync_write`;
3. the sender sends one byte "done"; the receiver's recv returns.

Verified here with protocol "tcp" on loopback; protocol "rdma" (with a device name) is the
same code path on an RDMA cluster, not verified here.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from miles_transfer.p2p.transports.base import Store, TransportError, check_buffer, recv_bytes
from miles_transfer.p2p.transports.socket import SocketMesh

__all__ = ["MooncakeTransport", "mooncake_available"]

_READY = struct.Struct("<QQ")  # receiver buffer address, bytes
_DONE = b"\x02"


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise ImportError(
            "MooncakeTransport needs Mooncake's transfer engine: pip install "
            "'miles-transfer[mooncake]' (or mooncake-transfer-engine on a CUDA cluster)"
        ) from exc
    return TransferEngine


def mooncake_available() -> bool:
    """Whether `mooncake.engine` imports in this environment."""
    try:
        _engine_class()
    except ImportError:
        return False
    return True


class MooncakeTransport(SocketMesh):
    """One-sided writes into the receiver's registered buffers (see the module docstring).

    Args:
        store, rank, host, prefix, timeout: as SocketMesh (the control plane).
        protocol: Mooncake protocol, "tcp" (anywhere) or "rdma".
        device: RDMA device name(s) for protocol "rdma" ("" lets Mooncake choose).
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        *,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        prefix: str = "miles-p2p",
        timeout: float = 300.0,
        api_key: str | None = None,
        insecure_no_auth: bool = False,
    ) -> None:
        engine_cls = _engine_class()
        super().__init__(
            store,
            rank,
            host=host,
            prefix=prefix,
            timeout=timeout,
            api_key=api_key,
            insecure_no_auth=insecure_no_auth,
        )
        self._engine = engine_cls()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            super().close()
            raise TransportError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                f"returned {rc}"
            )
        self._store.set(f"{prefix}/mooncake/{rank}", f"{host}:{self._engine.get_rpc_port()}")
        self._registered: dict[int, int] = {}
        self._targets: dict[int, str] = {}

    def _register(self, buf: torch.Tensor) -> int:
        """Register the memory behind `buf` (its whole storage, so views share one registration).

        A registered region that overlaps this storage belongs to memory that was freed and
        reused by the allocator (two live storages never overlap): Mooncake refuses overlapping
        registrations, and the old one must not stay writable anyway, so it is dropped first.
        """
        storage = buf.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or self._registered.get(base, -1) >= size:
            return buf.data_ptr()
        for start, length in list(self._registered.items()):
            if start < base + size and base < start + length:
                self._engine.unregister_memory(start)
                del self._registered[start]
        if self._engine.register_memory(base, size) != 0:
            raise TransportError(f"Mooncake could not register {size} bytes at {base:#x}")
        self._registered[base] = size
        return buf.data_ptr()

    def _target(self, peer: int) -> str:
        t = self._targets.get(peer)
        if t is None:
            key = f"{self._prefix}/mooncake/{peer}"
            self._store.wait([key])
            t = self._targets[peer] = self._store.get(key).decode()
        return t

    def send(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf, cpu=False)
        n = buf.numel()
        ptr = self._register(buf)
        try:
            conn = self.out_conn(peer)
            addr, want = _READY.unpack(recv_bytes(conn, _READY.size))
            if want != n:
                raise TransportError(
                    f"rank {peer} expects {want} bytes, rank {self.rank} sends {n}"
                )
            if n:
                rc = self._engine.transfer_sync_write(self._target(peer), ptr, addr, n)
                if rc != 0:
                    raise TransportError(
                        f"Mooncake write {self.rank} -> {peer} of {n} bytes returned {rc}"
                    )
            conn.sendall(_DONE)
        except OSError as exc:
            raise TransportError(f"rank {self.rank} -> {peer}: {exc}") from exc

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        check_buffer(buf, cpu=False)
        ptr = self._register(buf)
        try:
            conn = self.in_conn(peer)
            conn.sendall(_READY.pack(ptr, buf.numel()))
            if recv_bytes(conn, 1) != _DONE:
                raise TransportError(f"rank {peer} sent a bad completion")
        except OSError as exc:
            raise TransportError(f"rank {peer} -> {self.rank}: {exc}") from exc

    def close(self) -> None:
        for ptr in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered.clear()
        super().close()
