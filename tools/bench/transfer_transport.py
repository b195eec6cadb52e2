"""P2P transport throughput of miles-transfer vs a raw loopback socket copy of the same bytes.

Why: the weight-update pause of a rollout rank is the time it takes to receive and re-shard its
shards. This runs trainer and rollout ranks as separate processes on this host and measures for
rollout rank 0, per transport:
  raw    : the peer; plain loopback sockets (default options) carrying the same messages
           (`sendall` / `recv_into` preallocated buffers, one connection per sender)
  alone  : the transport carrying the same messages, no re-sharding copies
  update : a full P2P update (pack, transport, unpack into the rank's buffers): the pause,
           also given as seconds per GB

Transports: tcp, shm (same host), gloo (torch.distributed), mooncake (when installed; its TCP
protocol here, RDMA on a cluster). The in-process transport has no process boundary and is not
measured here.

Per repetition (medians of --reps after one warm-up) the three run back to back in the same
processes, so a loaded machine slows all three alike. A separate run checks the update bit
for bit.

Laptop / CI machine: python tools/bench/transfer_transport.py                 (about 1 minute)
Re-sharding 2 -> 2:  python tools/bench/transfer_transport.py --src-ranks 2 --dst-tp 2
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import socket
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_transfer import ShardReceiver, ShardSender, plan_transfer, tensor_digest
from miles_transfer.dist import shutdown_process_group
from miles_transfer.p2p import dst_peer, src_peer
from miles_transfer.p2p.layouts import (
    ModelShape,
    fsdp_layout,
    materialize,
    qwen3_params,
    sglang_layout,
)
from miles_transfer.p2p.transports import (
    MooncakeTransport,
    ShmTransport,
    TcpTransport,
    TorchDistributedTransport,
    mooncake_available,
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shape(a: argparse.Namespace) -> ModelShape:
    return ModelShape(
        hidden=a.hidden, intermediate=3 * a.hidden, num_layers=a.layers, num_heads=16,
        num_kv_heads=8, head_dim=a.hidden // 16, vocab=a.vocab,
    )  # fmt: skip


class _RawSockets:
    """The peer: plain loopback sockets (default options), one per (sender, receiver) pair."""

    def __init__(self, store: dist.TCPStore, rank: int, n_src: int, world: int) -> None:
        self.rank, self.conns = rank, {}
        if rank >= n_src:  # receivers listen, senders connect
            srv = socket.create_server(("127.0.0.1", 0))
            store.set(f"raw/{rank}", str(srv.getsockname()[1]))
            for _ in range(n_src):
                conn, _ = srv.accept()
                self.conns[int(conn.recv(4).decode())] = conn
            srv.close()
        else:
            for d in range(n_src, world):
                port = int(store.get(f"raw/{d}").decode())
                conn = socket.create_connection(("127.0.0.1", port))
                conn.sendall(f"{rank:4d}".encode())
                self.conns[d] = conn

    def send(self, peer: int, buf: torch.Tensor) -> None:
        view = memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
        self.conns[peer].sendall(view)

    def recv(self, peer: int, buf: torch.Tensor) -> None:
        view = memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
        got = 0
        while got < len(view):
            got += self.conns[peer].recv_into(view[got:])


def _p2p(rank: int, a: argparse.Namespace, kind: str, ports: tuple[int, int], out: str) -> None:
    """One rank; per repetition: raw sockets, the transport alone, then the full P2P update."""
    torch.set_num_threads(1)
    m = _shape(a)
    params = qwen3_params(m)
    src, dst = fsdp_layout(params, a.src_ranks), sglang_layout(m, tp=a.dst_tp)
    world = src.world_size + dst.world_size
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=timeout)
    if kind == "gloo":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        transport = TorchDistributedTransport(rank)
    else:
        cls = {"tcp": TcpTransport, "shm": ShmTransport, "mooncake": MooncakeTransport}[kind]
        transport = cls(store, rank, prefix=kind, timeout=300)
    raw = _RawSockets(store, rank, src.world_size, world)
    plan = plan_transfer(src, dst)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s.shape, generator=g).to(s.dtype) for n, s in params.items()}
    times: dict[str, list[float]] = {"raw": [], "alone": [], "p2p": []}
    bucket = a.bucket_mib << 20
    if rank < src.world_size:
        shards = materialize(src, rank, full)
        sender = ShardSender(plan, rank, transport, bucket_bytes=bucket)
        biggest = max((p.nbytes for _, _, p in sender.items), default=0)
        stage = torch.ones(biggest, dtype=torch.uint8)
        for i in range(a.reps + 1):
            for how, ep in (("raw", raw), ("alone", transport)):
                store.get(f"{how}/{i}")  # start together
                for d, _, prog in sender.items:  # the same messages, no re-sharding copies
                    ep.send(dst_peer(plan, d), stage[: prog.nbytes])
            store.get(f"p2p/{i}")
            sender.send(shards)
    else:
        d = rank - src.world_size
        bufs = dst.rank(d).allocate()
        recv = ShardReceiver(plan, d, transport, bucket_bytes=bucket)
        stages = {s: torch.zeros(max(p.nbytes for p in progs), dtype=torch.uint8)
                  for s, progs in recv.per_source.items()}  # fmt: skip

        def pull(ep: object, s: int) -> None:
            for prog in recv.per_source[s]:
                ep.recv(src_peer(plan, s), stages[s][: prog.nbytes])  # type: ignore[attr-defined]

        for i in range(a.reps + 1):
            for how, ep in (("raw", raw), ("alone", transport)):
                if d == 0:
                    store.set(f"{how}/{i}", "1")
                t = time.perf_counter()
                threads = [threading.Thread(target=pull, args=(ep, s)) for s in stages]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                times[how].append(time.perf_counter() - t)
            if d == 0:
                store.set(f"p2p/{i}", "1")
            rep = recv.receive(bufs)
            times["p2p"].append(rep.seconds)
            for b in bufs.values():
                b.zero_()  # the next update must write everything again
        torch.save({k: v[1:] for k, v in times.items()} | {"bytes": rep.bytes,
                    "buckets": len(rep.buckets)}, f"{out}.{d}")  # fmt: skip
    if kind == "gloo":
        dist.barrier()
        shutdown_process_group()
    else:
        store.set(f"done/{rank}", "1")
        store.wait([f"done/{r}" for r in range(world)])
    transport.close()


def _verify(a: argparse.Namespace, kind: str) -> bool:
    """One more update over `kind`, every rollout buffer checked bit for bit (not timed)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_verify_rank, args=(a, kind, (_port(), _port()), tmp), nprocs=_world(a), join=True)
        return all(torch.load(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("ok"))


def _verify_rank(
    rank: int, a: argparse.Namespace, kind: str, ports: tuple[int, int], tmp: str
) -> None:
    torch.set_num_threads(1)
    m = _shape(a)
    params = qwen3_params(m)
    src, dst = fsdp_layout(params, a.src_ranks), sglang_layout(m, tp=a.dst_tp)
    world = src.world_size + dst.world_size
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=timeout)
    if kind == "gloo":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        transport = TorchDistributedTransport(rank)
    else:
        cls = {"tcp": TcpTransport, "shm": ShmTransport, "mooncake": MooncakeTransport}[kind]
        transport = cls(store, rank, prefix=kind, timeout=300)
    plan = plan_transfer(src, dst)
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s.shape, generator=g).to(s.dtype) for n, s in params.items()}
    if rank < src.world_size:
        ShardSender(plan, rank, transport, bucket_bytes=a.bucket_mib << 20).send(
            materialize(src, rank, full)
        )
    else:
        d = rank - src.world_size
        bufs = dst.rank(d).allocate()
        ShardReceiver(plan, d, transport, bucket_bytes=a.bucket_mib << 20).receive(bufs)
        want = materialize(dst, d, full)
        same = all(tensor_digest(bufs[n]) == tensor_digest(t) for n, t in want.items())
        torch.save(same, os.path.join(tmp, f"ok{d}"))
    if kind == "gloo":
        dist.barrier()
        shutdown_process_group()
    else:
        store.set(f"done/{rank}", "1")
        store.wait([f"done/{r}" for r in range(world)])
    transport.close()


def _world(a: argparse.Namespace) -> int:
    return a.src_ranks + a.dst_tp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--src-ranks", type=int, default=1, help="FSDP trainer ranks")
    ap.add_argument("--dst-tp", type=int, default=1, help="rollout TP ranks")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transports", default="tcp,shm,gloo,mooncake")
    a = ap.parse_args()
    m = _shape(a)
    total = sum(s.numel * s.dtype.itemsize for s in qwen3_params(m).values())
    plan = plan_transfer(fsdp_layout(qwen3_params(m), a.src_ranks), sglang_layout(m, tp=a.dst_tp))
    per_rank = plan.bytes_needed(0)
    print(f"model {total / 2**20:.0f} MiB bf16; fsdp({a.src_ranks}) -> sglang(tp={a.dst_tp}); "
          f"rollout rank 0 receives {per_rank / 2**20:.0f} MiB; "
          f"buckets {a.bucket_mib} MiB")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.transports.split(","):
            if kind == "mooncake" and not mooncake_available():
                print("mooncake: not installed (pip install 'miles-transfer[mooncake]'), skipped")
                continue
            out = os.path.join(tmp, kind)
            mp.spawn(_p2p, args=(a, kind, (_port(), _port()), out), nprocs=_world(a), join=True)
            res = torch.load(f"{out}.0")
            n = res["bytes"]
            raw, alone, p2p = (statistics.median(res[k]) for k in ("raw", "alone", "p2p"))
            verified = _verify(a, kind)
            print(f"{kind}: raw sockets {n / raw / 1e9:.2f} GB/s; transport alone "
                  f"{n / alone / 1e9:.2f} GB/s = {raw / alone:.0%} of raw; full update (pause) "
                  f"{p2p:.3f} s in {res['buckets']} buckets = {n / p2p / 1e9:.2f} GB/s = "
                  f"{raw / p2p:.0%} of raw, {p2p / (n / 1e9):.2f} s/GB; "
                  f"bit-exact {verified}")  # fmt: skip


if __name__ == "__main__":
    main()
