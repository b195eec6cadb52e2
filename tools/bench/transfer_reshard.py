"""Re-sharding throughput of miles-transfer vs a plain memcpy of the same bytes.

Why: a P2P weight update re-shards every parameter from the trainer's layout into each rollout
rank's layout (fused QKV with GQA, gate_up, vocab-parallel rows, column/row-parallel slices).
The copies are strided; this measures how close the native C++ kernel and the PyTorch
reference get to a contiguous memcpy of the same number of bytes (target: >= 50%).

For every destination rank of the chosen layouts it times, interleaved, median of --reps:
  direct : copy_ops from the source shards straight into the destination buffers
  pack   : gather the same boxes into one contiguous bucket (what a sender does)
  memcpy : one contiguous copy of the same number of bytes (peer): torch copy_ and the native
           kernel on a single 1-D box (plain memcpy); ratios are against the faster one
Buffers are allocated and pre-faulted once (first-touch page faults are slower than copies).

Laptop / CI machine:  python tools/bench/transfer_reshard.py            (about 1 minute)
Bigger model:         python tools/bench/transfer_reshard.py --layers 16 --hidden 2048
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Literal

import torch

from miles_transfer import plan_transfer
from miles_transfer.p2p import (
    CopyOp,
    TransferPlan,
    copy_ops,
    pack,
    packed_bytes,
    reshard_native_available,
)
from miles_transfer.p2p.layouts import (
    ModelShape,
    fsdp_layout,
    materialize,
    megatron_layout,
    qwen3_params,
    sglang_layout,
)

Backend = Literal["native", "torch"]


def _time(fn, reps: int) -> float:
    fn()  # warm-up (and the first touch of any lazily created view)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _rank(plan: TransferPlan, d: int, shards: dict, reps: int) -> tuple[int, int, float, dict]:
    """Time one destination rank's copies; print and return (rank, bytes, memcpy s, times)."""
    bufs = plan.dst.rank(d).allocate()
    need = plan.bytes_needed(d)
    srcs = plan.sources_of(d)
    per = {s: plan.ops_between(s, d) for s in srcs}
    bucket = torch.zeros(max(packed_bytes(o) for o in per.values()), dtype=torch.uint8)
    a = torch.ones(need, dtype=torch.uint8)
    b = torch.zeros(need, dtype=torch.uint8)

    def direct(backend: Backend) -> None:
        for s in srcs:
            copy_ops(per[s], shards[s], bufs, backend=backend)

    def packed(backend: Backend) -> None:
        for s in srcs:
            pack(per[s], shards[s], bucket, backend=backend)

    # The peer: the same bytes as one contiguous copy, by torch (copy_) and by the native kernel
    # (a single 1-D box is one memcpy per 256 KiB chunk); ratios use the faster of the two.
    flat = CopyOp("flat", (0,), (need,), 0, "a", (need,), (0,), 0, "b", (need,), (0,), 1)
    backends: list[Backend] = ["native", "torch"] if reshard_native_available() else ["torch"]
    res = {"memcpy": _time(lambda: b.copy_(a), reps)}
    if reshard_native_available():
        res["memcpy-native"] = _time(
            lambda: copy_ops([flat], {"a": a}, {"b": b}, backend="native"), reps
        )
    for be in backends:
        res[f"direct-{be}"] = _time(lambda be=be: direct(be), reps)
        res[f"pack-{be}"] = _time(lambda be=be: packed(be), reps)
    res["memcpy2"] = _time(lambda: b.copy_(a), reps)  # again: drift check
    mem = min(v for k, v in res.items() if k.startswith("memcpy"))
    line = f"dst rank {d}: {need / 2**20:.0f} MiB from {len(srcs)} sources; "
    line += f"memcpy {need / mem / 1e9:.1f} GB/s"
    for k, v in res.items():
        if not k.startswith("memcpy"):
            line += f"; {k} {need / v / 1e9:.1f} GB/s ({mem / v:.0%})"
    print(line)
    return d, need, mem, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--src", choices=["megatron-tp2", "fsdp2", "megatron-tp4-pp2"], default="megatron-tp2"
    )
    ap.add_argument("--dst-tp", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = ModelShape(
        hidden=args.hidden, intermediate=3 * args.hidden, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        vocab=args.vocab,
    )  # fmt: skip
    params = qwen3_params(m)
    src = {
        "megatron-tp2": lambda: megatron_layout(m, tp=2),
        "fsdp2": lambda: fsdp_layout(params, 2),
        "megatron-tp4-pp2": lambda: megatron_layout(m, tp=4, pp=2),
    }[args.src]()
    dst = sglang_layout(m, tp=args.dst_tp)
    t = time.perf_counter()
    plan = plan_transfer(src, dst)
    plan_s = time.perf_counter() - t
    t = time.perf_counter()
    plan_transfer(src, dst)
    cached_s = time.perf_counter() - t
    total = sum(s.numel * s.dtype.itemsize for s in params.values())
    print(f"model {total / 2**20:.0f} MiB bf16, {src.kind} -> {dst.kind}, {len(plan.ops)} copies, "
          f"threads {args.threads}, native {reshard_native_available()}")  # fmt: skip
    print(f"plan: {plan_s * 1e3:.0f} ms first, {cached_s * 1e6:.0f} us cached")

    full = {n: torch.randn(s.shape, dtype=torch.float32).to(s.dtype) for n, s in params.items()}
    shards = {s: materialize(src, s, full) for s in range(src.world_size)}
    del full
    rows = [_rank(plan, d, shards, args.reps) for d in range(dst.world_size)]
    need = sum(r[1] for r in rows)
    mem = sum(r[2] for r in rows)
    keys = [k for k in rows[0][3] if not k.startswith("memcpy")]
    summary = "all ranks: " + "; ".join(
        f"{k} {need / sum(r[3][k] for r in rows) / 1e9:.1f} GB/s = "
        f"{mem / sum(r[3][k] for r in rows):.0%} of memcpy"
        for k in keys
    )
    print(summary + f" (memcpy {need / mem / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
