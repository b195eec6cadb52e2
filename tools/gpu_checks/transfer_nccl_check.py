"""miles-transfer P2P on a GPU: re-sharding on CUDA tensors and the NCCL transport, bit for bit.

Why: the CPU machines run every transport over gloo, TCP, shared memory and Mooncake-over-TCP,
but nothing CUDA. This short check (< 3 minutes) runs what only a GPU machine can:

1. Re-sharding on CUDA (copy_ops, pack, unpack; the PyTorch path on device) of a Megatron
   TP 2 / PP 2 layout into SGLang TP 4, dense and MoE (EP 2): identical bytes to the CPU result.
2. ShardSender -> ShardReceiver through the in-process transport with CUDA staging buffers
   (2 trainer threads -> 2 rollout threads), every rollout buffer checked bit for bit.
3. NCCL (needs >= 2 GPUs: NCCL refuses two ranks on one device): trainer rank 0 on cuda:0 sends
   FSDP-style shards to rollout TP ranks on the other GPUs through TorchDistributedTransport;
   each rollout rank checks its buffers bit for bit and reports GB/s. With one GPU the step is
   reported as SKIPPED (not failed).

Run from the repository root on a machine with a CUDA torch (no build needed: the native CPU
extension is optional and not used for CUDA tensors):
    PYTHONPATH=packages/miles-transfer/src python tools/gpu_checks/transfer_nccl_check.py
Exit code 0 when every step that ran passed. `--dry-run-cpu` runs steps 1-2 on CPU tensors
(what the CPU machines do to keep this script working; NCCL is skipped there).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_transfer import ShardReceiver, ShardSender, plan_transfer
from miles_transfer.p2p import copy_ops, pack, packed_bytes, unpack
from miles_transfer.p2p.layouts import (
    ModelShape,
    fsdp_layout,
    materialize,
    megatron_layout,
    qwen3_params,
    sglang_layout,
)
from miles_transfer.p2p.transports import InProcessHub, TorchDistributedTransport

DENSE = ModelShape(
    hidden=512, intermediate=1536, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
    vocab=5000,
)  # fmt: skip
MOE = ModelShape(
    hidden=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, vocab=3000,
    num_experts=8, moe_intermediate=128,
)  # fmt: skip


DEV = "cuda"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _bits(params, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(-(2**15), 2**15, s.shape, dtype=torch.int16, generator=g).view(s.dtype)
        for n, s in params.items()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].cpu().view(torch.int16), b[n].cpu().view(torch.int16)) for n in a)


def step_reshard_on_cuda() -> bool:
    ok = True
    for m, src, dst in (
        (DENSE, megatron_layout(DENSE, tp=2, pp=2), sglang_layout(DENSE, tp=4)),
        (MOE, megatron_layout(MOE, tp=2, ep=2), sglang_layout(MOE, tp=4, ep=2)),
    ):
        plan = plan_transfer(src, dst)
        full = _bits(qwen3_params(m), 0)
        for d in range(dst.world_size):
            want = materialize(dst, d, full)
            direct = {n: t.to(DEV) for n, t in dst.rank(d).allocate().items()}
            packed = {n: t.to(DEV) for n, t in dst.rank(d).allocate().items()}
            for s in plan.sources_of(d):
                ops = plan.ops_between(s, d)
                shards = {n: t.to(DEV) for n, t in materialize(src, s, full).items()}
                copy_ops(ops, shards, direct)
                buf = torch.empty(packed_bytes(ops), dtype=torch.uint8, device=DEV)
                pack(ops, shards, buf)
                unpack(ops, buf, packed)
            _sync()
            good = _same(want, direct) and _same(want, packed)
            ok &= good
            print(f"  {src.kind} -> {dst.kind} rank {d}: {'bit-exact' if good else 'MISMATCH'}")
    return ok


def step_inprocess_cuda() -> bool:
    plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 2), sglang_layout(DENSE, tp=2))
    full = _bits(qwen3_params(DENSE), 1)
    hub = InProcessHub(4, timeout=120)
    shards = {
        s: {n: t.to(DEV) for n, t in materialize(plan.src, s, full).items()} for s in range(2)
    }
    bufs = {d: {n: t.to(DEV) for n, t in plan.dst.rank(d).allocate().items()} for d in range(2)}
    errors: list[BaseException] = []

    def run(fn) -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    senders = [ShardSender(plan, s, hub.transport(s), bucket_bytes=1 << 20) for s in range(2)]
    recvs = [ShardReceiver(plan, d, hub.transport(2 + d), bucket_bytes=1 << 20) for d in range(2)]
    threads = [
        threading.Thread(target=run, args=(lambda s=s: senders[s].send(shards[s]),))
        for s in range(2)
    ]
    threads += [
        threading.Thread(target=run, args=(lambda d=d: recvs[d].receive(bufs[d]),))
        for d in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ok = not errors and all(_same(materialize(plan.dst, d, full), bufs[d]) for d in range(2))
    print(f"  in-process transport, CUDA staging: {'bit-exact' if ok else f'FAILED {errors}'}")
    return ok


def _nccl_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=120)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=dev)
    try:
        m = DENSE
        plan = plan_transfer(fsdp_layout(qwen3_params(m), 1), sglang_layout(m, tp=world - 1))
        full = _bits(qwen3_params(m), 2)
        transport = TorchDistributedTransport(rank)
        if rank == 0:
            shards = {n: t.to(DEV) for n, t in materialize(plan.src, 0, full).items()}
            sender = ShardSender(plan, 0, transport, bucket_bytes=4 << 20)
            for _ in range(3):
                sender.send(shards)
        else:
            d = rank - 1
            bufs = {n: t.to(DEV) for n, t in plan.dst.rank(d).allocate().items()}
            recv = ShardReceiver(plan, d, transport, bucket_bytes=4 << 20)
            reps = [recv.receive(bufs) for _ in range(3)]
            torch.cuda.synchronize()
            ok = _same(materialize(plan.dst, d, full), bufs)
            best = min(r.seconds for r in reps)
            with open(f"{out}.{rank}", "w") as f:
                f.write(f"{int(ok)} {reps[-1].bytes} {best}\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def step_nccl(tmp: str) -> bool | None:
    n = torch.cuda.device_count()
    if n < 2:
        print("  NCCL: SKIPPED (one GPU; NCCL does not allow two ranks on one device)")
        return None
    world = min(n, 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp, "nccl")
    mp.spawn(_nccl_rank, args=(world, port, out), nprocs=world, join=True)
    ok = True
    for r in range(1, world):
        with open(f"{out}.{r}") as f:
            good, nbytes, secs = f.read().split()
        ok &= good == "1"
        print(f"  NCCL rank {r}: {'bit-exact' if good == '1' else 'MISMATCH'}, "
              f"{int(nbytes) / 2**20:.0f} MiB in {float(secs):.4f} s = "
              f"{int(nbytes) / float(secs) / 1e9:.2f} GB/s")  # fmt: skip
    return ok


def main() -> int:
    global DEV
    dry = "--dry-run-cpu" in sys.argv[1:]
    if dry:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (or pass --dry-run-cpu)")
        return 2
    warnings.simplefilter("ignore", RuntimeWarning)  # "native extension unavailable" on CPU
    import tempfile

    t0 = time.perf_counter()
    results = {}
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPUs, tensors on {DEV}")
    print("1. re-sharding on CUDA tensors")
    results["reshard"] = step_reshard_on_cuda()
    print("2. pipelined transfer with CUDA staging (in-process)")
    results["inprocess"] = step_inprocess_cuda()
    print("3. NCCL transport")
    with tempfile.TemporaryDirectory() as tmp:
        results["nccl"] = None if dry else step_nccl(tmp)
    print(f"results: {results}, {time.perf_counter() - t0:.0f} s")
    return 0 if all(v is not False for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
