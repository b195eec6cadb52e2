"""The API key on the P2P mesh (issue 31): keyed TCP and shm transports move shards bit for bit;
a peer without the key (or with another) cannot connect, forged rendezvous values are refused,
and a non-loopback mesh without a key does not start."""

from __future__ import annotations

import datetime
import socket
import struct

import pytest
import torch
import torch.distributed as dist
from p2p_testutil import DENSE, random_bits, run_threads

from miles_transfer import plan_transfer, tensor_digest
from miles_transfer.p2p.layouts import fsdp_layout, materialize, qwen3_params, replicated_layout
from miles_transfer.p2p.transports import ShmTransport, TcpTransport, TransportError
from miles_transfer.p2p.transports.auth import MAGIC, SignedStore


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )


@pytest.mark.parametrize("cls", [TcpTransport, ShmTransport])
def test_a_keyed_mesh_moves_shards_bit_for_bit(cls: type) -> None:
    plan = plan_transfer(
        fsdp_layout(qwen3_params(DENSE), 2), replicated_layout(qwen3_params(DENSE))
    )
    world = plan.src.world_size + plan.dst.world_size
    store = _store()
    transports = [cls(store, r, prefix="k", timeout=30, api_key="mesh-key") for r in range(world)]
    try:
        full = random_bits(qwen3_params(DENSE), seed=0)
        shards = {s: materialize(plan.src, s, full) for s in range(plan.src.world_size)}
        buffers = {0: plan.dst.rank(0).allocate()}
        out = run_threads(plan, transports, shards, buffers, bucket_bytes=4096)
        assert not [v for v in out.values() if isinstance(v, BaseException)], out
        want = materialize(plan.dst, 0, full)
        assert all(tensor_digest(buffers[0][n]) == tensor_digest(t) for n, t in want.items())
    finally:
        for t in transports:
            t.close()
    # What the mesh wrote to the Store is signed: raw readers see a tag, not a bare address.
    assert store.get("k/addr/0").count(b"|") == 1


def _closed_by_peer(s: socket.socket) -> bool:
    """The other side closed the connection (EOF, or a reset when our bytes were unread)."""
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_peer_without_the_key_cannot_connect() -> None:
    store = _store()
    receiver = TcpTransport(store, 1, prefix="r", timeout=2, api_key="right")
    try:
        addr = SignedStore(store, "right").get("r/addr/1").decode()
        host, port = addr.rsplit(":", 1)
        # 1. The old 8-byte hello of an unkeyed peer, then shard bytes: never registered.
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(struct.pack("<q", 0) + b"\0" * 64)
            assert _closed_by_peer(s)
        # 2. A peer with another key: the receiver's proof does not verify, nor does the peer's.
        wrong = TcpTransport(store, 0, prefix="r", timeout=5, api_key="wrong")
        with pytest.raises(TransportError, match="signed with this API key"):
            wrong.send(1, torch.zeros(8, dtype=torch.uint8))  # the address is signed
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(struct.pack("<8sq16s", MAGIC, 0, b"n" * 16))
            s.recv(48)  # the receiver's nonce and proof
            s.sendall(b"\0" * 32)  # a wrong proof
            assert _closed_by_peer(s)
        wrong.close()
        # Nobody got in: rank 1 holds no connection from rank 0.
        with pytest.raises(TransportError, match="no connection from rank 0"):
            receiver.recv(0, torch.zeros(8, dtype=torch.uint8))
    finally:
        receiver.close()


def test_forged_rendezvous_values_are_refused() -> None:
    store = _store()
    signed = SignedStore(store, "k")
    signed.set("setup", '{"a": 1}')
    assert signed.get("setup") == b'{"a": 1}'
    store.set("setup", '{"a": 2}')  # someone who reaches the TCPStore but lacks the key
    with pytest.raises(TransportError, match="not signed with this API key"):
        signed.get("setup")
    tag = bytes(store.get("setup"))
    store.set("other", tag)  # a valid value replayed under another name
    with pytest.raises(TransportError):
        signed.get("other")


def test_a_public_mesh_needs_a_key() -> None:
    with pytest.raises(ValueError, match="--insecure-no-auth"):
        TcpTransport(_store(), 0, host="0.0.0.0", prefix="p", timeout=5)
