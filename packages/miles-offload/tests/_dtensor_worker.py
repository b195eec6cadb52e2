"""Worker of test_dtensor.test_two_ranks_match_torch: FSDP2 over two gloo ranks.

    python -m torch.distributed.run --standalone --nproc_per_node 2 _dtensor_worker.py OUT_DIR

The model's rows do not split evenly (5 rows: 3 and 2) and some parameters have fewer rows than
ranks (rank 1 holds empty shards). For "cpu" and "nvme": 3 steps beside torch's AdamW on the
same DTensors, a save (state_dict) and a load into an optimizer with another bucket size, 3 more
steps; with "nvme" also a resume from the directory into zeroed parameters and one more step.
Parameters and state must equal torch's bit for bit on every rank; each rank prints "OK".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _offload_testlib import HYPER
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import miles_offload as mo

TINY, OTHER = 0.002, 64.0  # bucket_mb: many buckets, then one


def _model(mesh: DeviceMesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(33, 47),
        torch.nn.Tanh(),
        torch.nn.Linear(47, 5),  # weight 5 x 47, bias 5: 3 + 2 rows
        torch.nn.Tanh(),
        torch.nn.Linear(5, 1),  # weight 1 x 5, bias 1: rank 1 holds empty shards
    )
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for k in steps:
        x = torch.randn(8, 33, generator=torch.Generator().manual_seed(k))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _check(model: torch.nn.Module, opt: mo.AdamW, ref: torch.nn.Module, ref_opt: Any) -> None:
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["state"].keys() == want["state"].keys(), (got["state"].keys(), want["state"])
    for i, w in want["state"].items():
        assert torch.equal(got["state"][i]["step"], w["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            g = got["state"][i][name]
            assert isinstance(g, DTensor)
            assert g.placements == w[name].placements
            assert g.shape == w[name].shape
            assert torch.equal(g.to_local(), w[name].to_local()), (i, name)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    for offload in ("cpu", "nvme"):
        ref = _model(mesh)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
        model = _model(mesh)
        local = [p.to_local().numel() for p in model.parameters()]
        assert (0 in local) == (rank == 1), local
        path = out / offload / f"rank{rank}"
        opt = mo.AdamW(
            model.parameters(), **HYPER, offload=offload, path=path / "a", bucket_mb=TINY
        )
        assert opt.num_buckets > 1
        _train(ref, ref_opt, range(3))
        _train(model, opt, range(3))
        _check(model, opt, ref, ref_opt)
        saved = opt.state_dict()
        opt.close()
        opt = mo.AdamW(
            model.parameters(), **HYPER, offload=offload, path=path / "b", bucket_mb=OTHER
        )
        assert opt.num_buckets == 1
        opt.load_state_dict(saved)
        _train(ref, ref_opt, range(3, 6))
        _train(model, opt, range(3, 6))
        _check(model, opt, ref, ref_opt)
        if offload == "nvme":
            opt.close()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            opt = mo.AdamW(
                model.parameters(),
                **HYPER,
                offload=offload,
                path=path / "b",
                bucket_mb=OTHER,
                resume=True,
            )
            _check(model, opt, ref, ref_opt)
            _train(ref, ref_opt, range(6, 7))
            _train(model, opt, range(6, 7))
            _check(model, opt, ref, ref_opt)
        opt.close()
    print(f"rank{rank} OK", flush=True)
    dist.destroy_process_group()
    # Leave without interpreter teardown: gloo's worker threads may still be dropping the last
    # collective's tensors, and one that asks for the GIL during teardown aborts the process
    # after its work succeeded (pytorch/pytorch#190489; miles_transfer.shutdown_process_group
    # documents it). Nothing is left to flush: stdout was flushed above, the files are closed.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
