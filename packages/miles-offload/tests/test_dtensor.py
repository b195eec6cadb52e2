"""FSDP2 DTensor parameters: the optimizer works on the local shards and matches torch's AdamW
(which steps the DTensors) bit for bit; state_dict holds DTensors with the parameters' layout.
On one rank (in process) and on two gloo ranks (torchrun) with uneven and empty shards, a save
and load across bucket sizes and a resume from the directory. miles-trainer's gloo test covers
a real model with offload="nvme"."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _offload_testlib import HYPER
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import miles_offload as mo


@pytest.fixture
def mesh() -> Iterator[object]:
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _model(mesh: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.Tanh(), torch.nn.Linear(47, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 33, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_fsdp2_shards_match_torch(mesh: object, offload: str, tmp_path: Path) -> None:
    ref = _model(mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, foreach=False)
    model = _model(mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = mo.AdamW(model.parameters(), **HYPER, offload=offload, path=tmp_path, bucket_mb=0.005)
    assert opt.num_buckets > 1
    _train(ref, ref_opt, 4)
    _train(model, opt, 4)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
    got, want = opt.state_dict(), ref_opt.state_dict()
    for i, w in want["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            g = got["state"][i][name]
            assert isinstance(g, DTensor)
            assert g.placements == w[name].placements
            assert g.shape == w[name].shape
            assert torch.equal(g.to_local(), w[name].to_local())
        assert torch.equal(got["state"][i]["step"], w["step"])


def test_two_ranks_match_torch(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(Path(__file__).with_name("_dtensor_worker.py")),
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank0 OK" in proc.stdout
    assert "rank1 OK" in proc.stdout
    for rank in (0, 1):
        assert (tmp_path / "nvme" / f"rank{rank}" / "b" / "manifest.json").exists()
