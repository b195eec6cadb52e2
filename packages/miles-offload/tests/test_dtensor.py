"""FSDP2 DTensor parameters: the optimizer works on the local shards and matches torch's AdamW
(which steps the DTensors) bit for bit; state_dict holds DTensors with the parameters' layout.
Two real ranks are covered by miles-trainer's gloo test with offload="nvme"."""

from __future__ import annotations

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
