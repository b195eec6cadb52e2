"""P2P transport throughput of miles-transfer vs a raw loopback socket copy of the same bytes.

Why: the weight-update pause of a rollout rank is the time it takes to receive and re-shard its
shards. This runs trainer and rollout ranks as separate processes on this host and measures,
per transport, the rollout rank's receive time (the pause) for a full update, as GB/s and as
seconds per GB, next to the peer: one process `sendall`-ing the same number of bytes to another
over a loopback TCP socket in chunks of the bucket size (`recv_into` a preallocated buffer).

Transports: tcp, shm (same host), gloo (torch.distributed), mooncake (when installed; its TCP
protocol here, RDMA on a cluster). The in-process transport has no process boundary and is not
measured here. Every measured update is verified bit for bit on the last repetition.

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
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_transfer import (
    ModelShape,
    MooncakeTransport,
    ShardReceiver,
    ShardSender,
    ShmTransport,
    TcpTransport,
    TorchDistributedTransport,
    fsdp_layout,
    materialize,
    mooncake_available,
    plan_transfer,
    qwen3_params,
    sglang_layout,
    tensor_digest,
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


def _raw(rank: int, port: int, nbytes: int, chunk: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    view = memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")
    times = []
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", port))
        conn, _ = srv.accept()
        for _ in range(reps + 1):
            conn.recv(1)  # receiver ready
            t = time.perf_counter()
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got : min(nbytes, got + chunk)])
                got += n
            times.append(time.perf_counter() - t)
        torch.save(times[1:], out)
    else:
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        for _ in range(reps + 1):
            conn.sendall(b"r")
            for a in range(0, nbytes, chunk):
                conn.sendall(view[a : a + chunk])


def _p2p(rank: int, a: argparse.Namespace, kind: str, ports: tuple[int, int], out: str) -> None:
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
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s.shape, generator=g).to(s.dtype) for n, s in params.items()}
    times = []
    if rank < src.world_size:
        shards = materialize(src, rank, full)
        sender = ShardSender(plan, rank, transport, bucket_bytes=a.bucket_mib << 20)
        for _ in range(a.reps + 1):
            store.get(f"go/{_}")  # start together
            sender.send(shards)
    else:
        d = rank - src.world_size
        bufs = dst.rank(d).allocate()
        recv = ShardReceiver(plan, d, transport, bucket_bytes=a.bucket_mib << 20)
        for i in range(a.reps + 1):
            if d == 0:
                store.set(f"go/{i}", "1")
            rep = recv.receive(bufs)
            times.append(rep.seconds)
            for b in bufs.values():
                b.zero_()  # the next update must write everything again
        ok = rep.bytes == plan.bytes_needed(d)
        torch.save({"times": times[1:], "bytes": rep.bytes, "ok": ok,
                    "buckets": len(rep.buckets)}, f"{out}.{d}")  # fmt: skip
    if kind == "gloo":
        dist.barrier()
        dist.destroy_process_group()
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
        dist.destroy_process_group()
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
        out = os.path.join(tmp, "raw")
        mp.spawn(
            _raw, args=(_port(), per_rank, a.bucket_mib << 20, a.reps, out), nprocs=2, join=True
        )
        raw = statistics.median(torch.load(out))
        print(f"raw loopback socket, {per_rank / 2**20:.0f} MiB: {per_rank / raw / 1e9:.2f} GB/s "
              f"({raw / (per_rank / 1e9):.2f} s/GB)")  # fmt: skip
        for kind in a.transports.split(","):
            if kind == "mooncake" and not mooncake_available():
                print("mooncake: not installed (pip install 'miles-transfer[mooncake]'), skipped")
                continue
            out = os.path.join(tmp, kind)
            mp.spawn(_p2p, args=(a, kind, (_port(), _port()), out), nprocs=_world(a), join=True)
            res = torch.load(f"{out}.0")
            t = statistics.median(res["times"])
            verified = _verify(a, kind)
            print(f"{kind}: rank 0 pause {t:.3f} s for {res['bytes'] / 2**20:.0f} MiB in "
                  f"{res['buckets']} buckets = {res['bytes'] / t / 1e9:.2f} GB/s, "
                  f"{t / (res['bytes'] / 1e9):.2f} s/GB, {raw / t * res['bytes'] / per_rank:.0%} "
                  f"of raw socket; bit-exact {verified}")  # fmt: skip


if __name__ == "__main__":
    main()
