"""The API key on the P2P mesh: an HMAC challenge on every connection, signed Store values.

With a key, a connection is accepted only after both sides proved they hold it (the key never
travels; fresh nonces make a recorded exchange useless):

    client -> server   MAGIC (8) | rank (int64) | client nonce (16)
    server -> client   server nonce (16) | HMAC(key, "server" | nonces | rank)
    client -> server   HMAC(key, "client" | nonces | rank)

so a peer without the key can neither inject shards into a receiver nor pose as one to take the
trainer's weights. Every value written to the rendezvous Store (listening addresses, the setup,
update announcements, digests, the sink's reports) carries an HMAC of its key and value, checked
on read, so nobody without the key can redirect a sender or forge a report. Without a key the
mesh is the trusted-network mesh it was (an 8-byte rank hello), and binding it to a non-loopback
address refuses to start unless ``insecure_no_auth``. Mooncake's data plane (its own RPC and
RDMA) is outside this: use it on a trusted fabric.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Any

from miles_transfer.p2p.transports.base import TransportError, recv_bytes
from miles_transfer.protocols import Store

__all__ = ["SignedStore", "accept_handshake", "connect_handshake"]

MAGIC = b"MILESP2P"
_NONCE = 16
_MAC = hashlib.sha256().digest_size
_HELLO = struct.Struct("<8sq16s")
_RANK = struct.Struct("<q")


def _mac(key: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, rank: int) -> bytes:
    msg = role + client_nonce + server_nonce + _RANK.pack(rank)
    return hmac.new(key, msg, hashlib.sha256).digest()


def connect_handshake(sock: socket.socket, rank: int, key: bytes) -> None:
    """The client's side (the sender that opened ``sock``).

    Raises:
        TransportError: the server did not prove the key (a wrong key or not a Miles peer).
    """
    cn = os.urandom(_NONCE)
    sock.sendall(_HELLO.pack(MAGIC, rank, cn))
    answer = recv_bytes(sock, _NONCE + _MAC)
    sn, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"server", cn, sn, rank)):
        raise TransportError(
            "the P2P peer did not prove the API key: both sides need the same key "
            "(--api-key / MILES_API_KEY)"
        )
    sock.sendall(_mac(key, b"client", cn, sn, rank))


def accept_handshake(sock: socket.socket, key: bytes) -> int:
    """The server's side (the receiver that accepted ``sock``); returns the peer's rank.

    Raises:
        TransportError: the peer is not a Miles peer or did not prove the key.
    """
    magic, rank, cn = _HELLO.unpack(recv_bytes(sock, _HELLO.size))
    if magic != MAGIC:
        raise TransportError("a connection without the P2P greeting (not a keyed Miles peer)")
    sn = os.urandom(_NONCE)
    sock.sendall(sn + _mac(key, b"server", cn, sn, rank))
    proof = recv_bytes(sock, _MAC)
    if not hmac.compare_digest(proof, _mac(key, b"client", cn, sn, rank)):
        raise TransportError(f"a peer claiming rank {rank} did not prove the API key")
    return int(rank)


class SignedStore:
    """A Store whose values carry an HMAC of (key name, value): forged or altered values raise.

    Args:
        store: the underlying Store (a TCPStore anyone who reaches it could write).
        key: the API key.
    """

    def __init__(self, store: Store, key: str) -> None:
        self._store = store
        self._key = key.encode()

    def _tag(self, name: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, name.encode() + b"\0" + value, hashlib.sha256)
        return mac.hexdigest().encode()

    def set(self, key: str, value: str | bytes) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        store: Any = self._store  # torch's Store.set takes bytes as well as str
        store.set(key, self._tag(key, raw) + b"|" + raw)

    def get(self, key: str) -> bytes:
        raw = bytes(self._store.get(key))
        tag, sep, value = raw.partition(b"|")
        if not sep or not hmac.compare_digest(tag, self._tag(key, value)):
            raise TransportError(
                f"the rendezvous value {key!r} is not signed with this API key: another key, or "
                "someone else wrote it"
            )
        return value

    def wait(self, keys: list[str]) -> None:
        self._store.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))
