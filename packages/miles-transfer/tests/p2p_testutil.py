"""Helpers for the P2P tests: a module with HF parameter names, thread-run transfers."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from miles_transfer import ShardReceiver, ShardSender
from miles_transfer.p2p import TransferPlan, TransferReport, dst_peer, src_peer
from miles_transfer.p2p.layouts import ModelShape, ParamSpec
from miles_transfer.p2p.transports import (
    InProcessHub,
    MooncakeTransport,
    ShmTransport,
    TcpTransport,
    Transport,
)


def module_with(params: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module whose state_dict holds exactly these tensors under these dotted names."""
    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def make_transports(kind: str, world: int) -> list[Transport]:
    """One endpoint per rank of a `world`-rank group, all in this process."""
    if kind == "inprocess":
        hub = InProcessHub(world, timeout=60)
        return [hub.transport(r) for r in range(world)]
    store = dist.TCPStore(
        "127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    cls: Callable[..., Transport] = {
        "tcp": TcpTransport,
        "shm": ShmTransport,
        "mooncake": MooncakeTransport,
    }[kind]
    return [cls(store, r, prefix=kind, timeout=60) for r in range(world)]


def run_threads(
    plan: TransferPlan,
    transports: list[Transport],
    shards: Mapping[int, Mapping[str, torch.Tensor]],
    buffers: Mapping[int, Mapping[str, torch.Tensor]],
    *,
    bucket_bytes: int,
    depth: int = 2,
    senders: dict[int, ShardSender] | None = None,
    receivers: dict[int, ShardReceiver] | None = None,
) -> dict[tuple[str, int], TransferReport | BaseException]:
    """Every source and destination rank as a thread; reports (or errors) by (role, rank)."""
    if senders is None:
        senders = {
            s: ShardSender(
                plan, s, transports[src_peer(plan, s)], bucket_bytes=bucket_bytes, depth=depth
            )
            for s in shards
        }
    if receivers is None:
        receivers = {
            d: ShardReceiver(
                plan, d, transports[dst_peer(plan, d)], bucket_bytes=bucket_bytes, depth=depth
            )
            for d in buffers
        }
    out: dict[tuple[str, int], TransferReport | BaseException] = {}

    def go(key: tuple[str, int], fn: Callable[[], TransferReport]) -> None:
        try:
            out[key] = fn()
        except BaseException as exc:
            out[key] = exc

    threads = [
        threading.Thread(target=go, args=(("send", s), lambda s=s: senders[s].send(shards[s])))
        for s in shards
    ] + [
        threading.Thread(
            target=go, args=(("recv", d), lambda d=d: receivers[d].receive(buffers[d]))
        )
        for d in buffers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a transfer thread hung"
    return out


def spec_dict(params: Mapping[str, ParamSpec]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (s.shape, s.dtype) for n, s in params.items()}


def random_bits(params, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full tensors of random bit patterns (NaN payloads and -0.0 included)."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(-(2**15), 2**15, s.shape, dtype=torch.int16, generator=g).view(s.dtype)
        for n, s in params.items()
    }


DENSE = ModelShape(
    hidden=32, intermediate=48, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, vocab=200
)
MOE = ModelShape(
    hidden=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab=100,
    num_experts=4,
    moe_intermediate=8,
    tie_word_embeddings=True,
)
