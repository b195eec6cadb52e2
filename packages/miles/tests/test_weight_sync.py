"""``transfer.method`` in a recipe: validation naming the key, and the factory's choice."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from miles.config import load_recipe
from miles.weight_sync import DeltaSync, P2PSync, PushSync, build_weight_sync
from miles_transfer import HTTPReceiver, ModuleReceiver, tensor_digest
from miles_transfer.push import WeightServer


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "transfer.method=rsync",
            "transfer.method must be one of ['push', 'p2p', 'delta', 'colocated']",
        ),
        ("transfer.p2p.transport=rdma", "transfer.p2p.transport must be one of ['tcp', 'shm']"),
        ("transfer.p2p.agent=localhost", "transfer.p2p.agent must be 'host:port'"),
        ("transfer.delta.encoding=gzip", "transfer.delta.encoding must be one of"),
        ("transfer.delta.full_every=0", "transfer.delta.full_every must be >= 1"),
        ("transfer.delta.every=3", "transfer.delta.every"),
    ],
)
def test_bad_transfer_settings_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe("arith-tiny", [override])


def test_the_method_picks_the_sync(tmp_path: Path) -> None:
    cfg = load_recipe("arith-tiny", ["transfer.method=push"])
    assert isinstance(build_weight_sync(cfg, None), PushSync)
    cfg = load_recipe("arith-tiny", ["transfer.method=p2p", "transfer.p2p.transport=shm"])
    sync = build_weight_sync(cfg, None)
    assert isinstance(sync, P2PSync)
    assert sync.transport == "shm"
    cfg = load_recipe("arith-tiny", ["transfer.method=delta", "transfer.delta.full_every=3"])
    sync = build_weight_sync(cfg, None, run_dir=tmp_path / "run")
    assert isinstance(sync, DeltaSync)
    assert sync.root == tmp_path / "run" / "weights"
    assert sync.full_every == 3
    assert not (tmp_path / "run").exists()  # nothing is written before the first sync
    cfg = load_recipe("arith-tiny", ["transfer.method=delta", f"transfer.delta.dir={tmp_path}/w"])
    assert build_weight_sync(cfg, None).root == tmp_path / "w"  # type: ignore[attr-defined]


def test_delta_without_a_directory_is_refused_before_the_run() -> None:
    cfg = load_recipe("arith-tiny", ["transfer.method=delta"])
    with pytest.raises(ValueError, match=r"transfer\.delta\.dir"):
        build_weight_sync(cfg, None)


class _ModuleTrainer:
    """The part of the Trainer protocol a weight sync reads: one process holding a module."""

    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def test_delta_into_a_server_and_a_resumed_run_starts_a_fresh_chain(tmp_path: Path) -> None:
    """DeltaSync against SGLang's disk route (WeightServer over a bf16 module): versions are
    pulled, reloaded and verified bit for bit; a second sync object on the same run directory
    (a resumed run) clears the old chain and publishes a full snapshot first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    engine_model = copy.deepcopy(model).to(torch.bfloat16)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = load_recipe("arith-tiny", ["transfer.method=delta", f"model_path={ckpt}"])
    run = tmp_path / "run"
    with WeightServer(ModuleReceiver(engine_model)) as server:
        for attempt in range(2):
            sync = build_weight_sync(cfg, HTTPReceiver(server.url), run_dir=run)
            kinds = []
            for version in (1, 2) if attempt == 0 else (2, 3):
                if attempt or version > 1:
                    model(torch.randn(8, 16)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                out = sync.sync(_ModuleTrainer(model), version)
                kinds.append(out["kind"])
                assert out["verified"] is True
                want = {
                    n: tensor_digest(t.to(torch.bfloat16)) for n, t in model.state_dict().items()
                }
                assert HTTPReceiver(server.url).weights_checksum() == want
                assert server.receiver.weight_version == str(version)  # type: ignore[attr-defined]
            assert kinds == ["full", "delta"]
        versions = sorted(p.name for p in (run / "weights").glob("weight_v*"))
        assert versions == ["weight_v000002", "weight_v000003"]
