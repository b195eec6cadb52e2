"""End to end across processes: real FSDP2 shards on 2 trainer ranks -> 2 rollout ranks (TP 2).

Four processes in one gloo group: ranks 0-1 train (a module with Qwen3 HF names, `fully_shard`
over a 2-rank mesh; each sends its own local shards, nobody gathers), ranks 2-3 are the rollout
engine's TP ranks in SGLang's layout (fused qkv_proj with GQA, gate_up_proj, vocab-parallel
embedding). Step 1 moves the weights over torch.distributed (gloo), step 2 (new weights) over
TCP and step 3 over shared memory; each rollout rank checks every buffer bit for bit against
the reference slicing of the full tensors.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from p2p_testutil import module_with, random_bits

from miles_transfer import ShardReceiver, ShardSender, plan_transfer, tensor_digest
from miles_transfer.dist import shutdown_process_group
from miles_transfer.p2p import module_param_specs, module_shards
from miles_transfer.p2p.layouts import (
    ModelShape,
    fsdp_layout,
    materialize,
    qwen3_params,
    sglang_layout,
)
from miles_transfer.p2p.transports import ShmTransport, TcpTransport, TorchDistributedTransport

# Odd sizes so FSDP2's dim-0 chunks are uneven (vocab 101 -> 51 + 50 rows; head_dim 3).
SHAPE = ModelShape(
    hidden=24, intermediate=40, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=3, vocab=101
)


def _worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # File rendezvous (no port to pick): the group and the transports' store are files.
    timeout = datetime.timedelta(seconds=120)
    init = f"file://{os.path.join(out_dir, 'pg')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "fsdp"))
        params = qwen3_params(SHAPE)
        dst = sglang_layout(SHAPE, tp=2)
        store = dist.FileStore(os.path.join(out_dir, "store"), world)
        store.set_timeout(timeout)
        results: dict[str, object] = {}
        trainer = rank < 2
        if trainer:
            model = module_with(random_bits(params, seed=0))
            fully_shard(model, mesh=mesh["fsdp"])
            specs = module_param_specs(model)
            src = fsdp_layout(specs, 2)
            shards = module_shards(model)
            # The layout says exactly what FSDP2 holds on this rank.
            results["fsdp_matches"] = {
                n: tensor_digest(shards[n]) == tensor_digest(t)
                for n, t in materialize(src, rank, random_bits(params, seed=0)).items()
            }
        else:
            src = fsdp_layout(params, 2)  # the rollout side knows the trainer's layout
        plan = plan_transfer(src, dst)
        transports = [
            TorchDistributedTransport(rank),
            TcpTransport(store, rank, prefix="tcp", timeout=120),
            ShmTransport(store, rank, prefix="shm", timeout=120),
        ]
        for step, transport in enumerate(transports):
            full = random_bits(params, seed=step)
            if trainer:
                if step:  # a new version of the weights, written into the FSDP2 shards
                    for n, t in materialize(src, rank, full).items():
                        shards[n].copy_(t)
                rep = ShardSender(plan, rank, transport, bucket_bytes=2048).send(shards)
                results[f"sent{step}"] = rep.bytes
            else:
                d = rank - 2
                bufs = dst.rank(d).allocate()
                rep = ShardReceiver(plan, d, transport, bucket_bytes=2048).receive(bufs)
                want = materialize(dst, d, full)
                results[f"equal{step}"] = {
                    n: tensor_digest(bufs[n]) == tensor_digest(t) for n, t in want.items()
                }
                results[f"bytes{step}"] = (rep.bytes, plan.bytes_needed(d), len(rep.buckets))
            dist.barrier()
        for t in transports:
            t.close()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        shutdown_process_group()  # waits for gloo's workers first: see miles_transfer docs


def test_fsdp2_trainer_to_tp2_rollout_over_gloo_tcp_and_shm(tmp_path):
    mp.spawn(_worker, args=(4, str(tmp_path)), nprocs=4, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    plan = plan_transfer(fsdp_layout(qwen3_params(SHAPE), 2), sglang_layout(SHAPE, tp=2))
    for r in (0, 1):
        assert res[r]["fsdp_matches"]
        assert all(res[r]["fsdp_matches"].values())
    for r in (2, 3):
        for step in range(3):
            eq = res[r][f"equal{step}"]
            assert eq
            assert all(eq.values()), (r, step, [n for n, ok in eq.items() if not ok])
            got, need, buckets = res[r][f"bytes{step}"]
            assert got == need == plan.bytes_needed(r - 2)
            assert buckets > 1
    for step in range(3):
        sent = res[0][f"sent{step}"] + res[1][f"sent{step}"]
        assert sent == plan.bytes_needed(0) + plan.bytes_needed(1)
