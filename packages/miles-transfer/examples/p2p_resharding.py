"""P2P weight transfer with only torch and miles-transfer: FSDP2 trainers -> a TP 2 engine.

Why: shows the P2P path in another RL stack. Two trainer processes train a plain PyTorch model
sharded with FSDP2 (gloo); two "engine" processes hold the same model tensor-parallel (first
Linear column parallel, second row parallel, the engine's own layout described with
`split_layout`). After every optimizer step each trainer rank sends its own FSDP2 shards
(nothing is gathered) and each engine rank receives exactly its TP slices into its own weight
buffers and runs its half of the forward. At the end every slice is checked bit for bit against
the trainer's full weights, and the engine's output (the two partial sums added) against the
trainer's output.

Laptop (CPU, a few seconds):  python examples/p2p_resharding.py --steps 3
A cluster: the same calls with NCCL (TorchDistributedTransport, CUDA buffers) or Mooncake.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_transfer import ShardReceiver, ShardSender, plan_transfer, tensor_digest
from miles_transfer.dist import shutdown_process_group
from miles_transfer.p2p import module_param_specs, module_shards
from miles_transfer.p2p.layouts import fsdp_layout, materialize, split_layout
from miles_transfer.p2p.transports import TcpTransport

IN, HIDDEN, OUT = 16, 64, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )


def engine_forward(w: dict[str, torch.Tensor], x: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """One TP rank's share of the forward: its hidden columns, a partial sum of the output."""
    h = torch.tanh(x @ w["0.weight"].T + w["0.bias"])
    part = h @ w["2.weight"].T
    return part + w["2.bias"] if tp_rank == 0 else part


def run(rank: int, world: int, ports: tuple[int, int], steps: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "fsdp"))
    store = dist.TCPStore("127.0.0.1", ports[1], world, rank == 0, timeout=timeout)
    specs = module_param_specs(make_model())
    src = fsdp_layout(specs, 2)  # trainer ranks 0-1
    dst = split_layout(specs, 2, {"0.weight": 0, "0.bias": 0, "2.weight": 1})  # engine ranks 2-3
    plan = plan_transfer(src, dst)  # cached: free after the first step
    transport = TcpTransport(store, rank, timeout=60)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(1))
    if rank < 2:  # trainer
        model = make_model()
        fully_shard(model, mesh=mesh["fsdp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sender = ShardSender(plan, rank, transport, bucket_bytes=1024)
        for step in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sender.send(module_shards(model))  # this rank's shards only: nothing is gathered
            # For the check below only: the full weights and the trainer's output.
            # (Collectives: both trainer ranks take part; rank 0 writes.)
            full = {n: t.full_tensor() for n, t in model.state_dict().items()}
            with torch.no_grad():
                y = model(x)
            if rank == 0:
                torch.save((full, y), os.path.join(out_dir, f"trainer{step}.pt"))
    else:  # engine TP rank
        t = rank - 2
        weights = dst.rank(t).allocate()  # the engine's own buffers
        receiver = ShardReceiver(plan, t, transport, bucket_bytes=1024)
        for step in range(steps):
            report = receiver.receive(weights)
            with torch.no_grad():
                part = engine_forward(weights, x, t)
            saved = {n: w.clone() for n, w in weights.items()}
            torch.save((saved, part, report.bytes, len(report.buckets)),
                       os.path.join(out_dir, f"engine{step}.{t}.pt"))  # fmt: skip
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    transport.close()
    # Not dist.destroy_process_group() alone: gloo's worker threads may still be releasing
    # the last collective's tensors, and a process that exits then can abort (see its doc).
    shutdown_process_group()


def check(out_dir: str, steps: int) -> None:
    dst = split_layout(
        module_param_specs(make_model()), 2, {"0.weight": 0, "0.bias": 0, "2.weight": 1}
    )
    for step in range(steps):
        full, want = torch.load(os.path.join(out_dir, f"trainer{step}.pt"))
        parts = []
        for t in range(2):
            weights, part, nbytes, buckets = torch.load(
                os.path.join(out_dir, f"engine{step}.{t}.pt")
            )
            ref = materialize(dst, t, full)
            assert all(tensor_digest(weights[n]) == tensor_digest(r) for n, r in ref.items())
            parts.append(part)
            print(f"step {step}: engine rank {t} received {nbytes} B in {buckets} buckets, "
                  "every slice bit-exact")  # fmt: skip
        y = parts[0] + parts[1]  # the engine's TP all-reduce
        assert torch.allclose(y, want, atol=1e-6), (y, want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(4, tuple(ports), args.steps, tmp), nprocs=4, join=True)
        check(tmp, args.steps)
    print("p2p example: every engine slice bit-exact, engine outputs match the trainer's")


if __name__ == "__main__":
    main()
