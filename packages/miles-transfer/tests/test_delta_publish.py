"""Versioned publishing, pulling with bounded chains, engine-side apply (pause only the swap)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from delta_testutil import same_files

from miles_transfer import (
    DeltaPublisher,
    DeltaSubscriber,
    HTTPReceiver,
    ModuleReceiver,
    tensor_digest,
    update_engine_from_delta,
)
from miles_transfer.checkpoint import iter_safetensors, save_safetensors
from miles_transfer.delta import DeltaBaseError, update_engine_via_disk
from miles_transfer.push import ReceiverError, WeightServer, iter_full_state

pytest.importorskip("xxhash")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in iter_full_state(model)}


def test_publish_pull_chain_with_full_snapshots(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = DeltaPublisher(tmp_path / "pub", full_every=3, other_files={"config.json": b"{}"})
    states = []
    for v in range(7):
        if v:
            _train(model, opt, v)
        report = pub.publish(iter_full_state(model))
        states.append(_bf16_state(model))
        assert report.version == v
        assert report.kind == ("full" if v % 3 == 0 else "delta")
        if v:
            assert report.delta is not None
            assert report.delta.payload_bytes < report.full_bytes
    assert (tmp_path / "pub" / "LATEST").read_text() == "6"
    names = sorted(p.name for p in (tmp_path / "pub").iterdir())
    assert names == ["LATEST"] + [f"weight_v{v:06d}" for v in range(7)]
    assert (tmp_path / "pub" / "weight_v000003" / "delta" / "delta.json").is_file()
    meta = json.loads((tmp_path / "pub" / "weight_v000004" / "version.json").read_text())
    assert meta == {"version": 4, "kind": "delta", "base": 3}

    # A fresh host copies the latest snapshot (6) and applies nothing after it.
    fresh = DeltaSubscriber(tmp_path / "pub", tmp_path / "fresh")
    got = fresh.pull()
    assert got.steps == ("full 6",)
    # A host a few versions behind applies the deltas in between (even across a snapshot).
    sub = DeltaSubscriber(tmp_path / "pub", tmp_path / "host", keep=3)
    assert sub.pull(version=1).steps == ("full 0", "delta 1")
    assert sub.pull(version=4).steps == ("delta 2", "delta 3", "delta 4")
    assert sub.pull().steps == ("delta 5", "delta 6")
    # Catching up writes only the newest version (no intermediate checkpoints).
    assert sorted(os.listdir(tmp_path / "host")) == [f"weight_v{v:06d}" for v in (1, 4, 6)]
    # Further behind than max_chain: the newest snapshot at or before the target, then deltas.
    far = DeltaSubscriber(tmp_path / "pub", tmp_path / "far", max_chain=2)
    far.pull(version=0)
    got = far.pull(version=5)
    assert got.steps == ("full 3", "delta 4", "delta 5")
    assert got.previous == 0
    for d in (sub.path(), fresh.path()):
        loaded = dict(iter_safetensors(d))
        assert loaded.keys() == states[6].keys()
        assert all(torch.equal(loaded[n], states[6][n]) for n in loaded)
        assert (d / "config.json").read_bytes() == b"{}"
    assert same_files(sub.path(), fresh.path())


def test_publisher_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="precision must be one of"):
        DeltaPublisher(tmp_path / "a", precision="fp4")
    pub = DeltaPublisher(tmp_path / "b")
    pub.publish([("w", torch.zeros(3))])
    with pytest.raises(ValueError, match="must be greater"):
        pub.publish([("w", torch.ones(3))], version=0)
    with pytest.raises(ValueError, match="already holds published versions"):
        DeltaPublisher(tmp_path / "b")
    with pytest.raises(ValueError, match="nothing published"):
        DeltaSubscriber(tmp_path / "empty", tmp_path / "local").pull()


@pytest.fixture
def served(tmp_path):
    """A bf16 inference copy behind SGLang's HTTP API (WeightServer) and two published
    versions of a trained policy, pulled to the engine host."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = DeltaPublisher(tmp_path / "pub", full_every=100)
    pub.publish(iter_full_state(model))
    _train(model, opt, 1)
    pub.publish(iter_full_state(model))
    engine_model = _model(0).to(torch.bfloat16)  # serves version 0 (bf16 cast of the same init)
    with WeightServer(ModuleReceiver(engine_model)) as server:
        yield server, HTTPReceiver(server.url), pub, _bf16_state(model), tmp_path


def test_update_engine_from_delta_pauses_only_for_the_swap(served):
    server, engine, pub, want, tmp_path = served
    sub = DeltaSubscriber(pub.root, tmp_path / "host")
    sub.pull(version=0)
    report = update_engine_from_delta(engine, sub.path(0), pub.root / "weight_v000001")
    assert report.weight_version == "1"
    assert report.changed_tensors == 4
    assert report.pause_seconds > 0
    assert server.pause_calls == ["in_place"]
    assert not server.paused
    assert engine.weights_checksum() == {n: tensor_digest(t) for n, t in want.items()}
    assert server.receiver.weight_version == "1"  # type: ignore[attr-defined]


def test_update_engine_via_disk_materializes_then_one_reload(served):
    server, engine, pub, want, tmp_path = served
    sub = DeltaSubscriber(pub.root, tmp_path / "host")
    sub.pull(version=0)
    out = tmp_path / "host" / "weight_v000001"
    report = update_engine_via_disk(engine, sub.path(0), pub.root / "weight_v000001", out)
    assert report.path == out
    assert sub.version == 1  # the materialized dir is the subscriber's next version
    assert server.pause_calls == ["in_place"]
    assert engine.weights_checksum() == {n: tensor_digest(t) for n, t in want.items()}


def test_engine_keeps_serving_the_old_version_on_failure(served):
    server, engine, pub, _, tmp_path = served
    sub = DeltaSubscriber(pub.root, tmp_path / "host")
    sub.pull(version=0)
    # Wrong base: refused before the engine is touched (no pause at all).
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    state = _bf16_state(_model(0))
    save_safetensors([(n, t + 1) for n, t in state.items()], wrong / "model.safetensors")
    with pytest.raises(DeltaBaseError):
        update_engine_from_delta(engine, wrong, pub.root / "weight_v000001")
    assert server.pause_calls == []
    # An engine that refuses the update (its model lacks a layer) keeps its weights and
    # version, and generation is continued.
    odd = torch.nn.Sequential(torch.nn.Linear(32, 64)).to(torch.bfloat16)
    with WeightServer(ModuleReceiver(odd)) as other:
        odd_engine = HTTPReceiver(other.url)
        before = odd_engine.weights_checksum()
        with pytest.raises(ReceiverError, match="nothing written"):
            update_engine_from_delta(odd_engine, sub.path(0), pub.root / "weight_v000001")
        assert other.pause_calls == ["in_place"]
        assert not other.paused
        assert odd_engine.weights_checksum() == before


def test_engine_follower_keeps_an_engine_on_the_newest_version(tmp_path):
    """In memory on the engine's side: full snapshot first, deltas after (also the delta kept
    inside a later full snapshot), a late follower catches up in one swap; bits equal."""
    from miles_transfer.delta import EngineFollower

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pub = DeltaPublisher(tmp_path / "pub", full_every=3, other_files={"config.json": b"{}"})
    engine_model = _model(1).to(torch.bfloat16)
    with WeightServer(ModuleReceiver(engine_model)) as server:
        engine = HTTPReceiver(server.url)
        follower = EngineFollower(engine, pub.root)
        receiver = server.receiver
        for v in range(4):
            if v:
                _train(model, opt, v)
            pub.publish(iter_full_state(model))
            rep = follower.update()
            want = _bf16_state(model)
            assert engine.weights_checksum() == {n: tensor_digest(t) for n, t in want.items()}
            assert rep.weight_version == str(v) == receiver.weight_version  # type: ignore[attr-defined]
            assert server.pause_calls[-1] == "in_place"
            assert not server.paused
            full = sum(t.numel() * t.element_size() for t in want.values())
            if v == 0:
                assert rep.steps == ("full 0",)
                assert rep.read_bytes == full
            else:
                assert rep.steps == (f"delta {v}",)  # v 3 is a full snapshot: its delta/ is read
                assert 0 < rep.read_bytes < full
            assert rep.pause_seconds > 0
        late = EngineFollower(HTTPReceiver(server.url), pub.root)
        rep = late.update(2)
        assert rep.steps == ("full 0", "delta 1", "delta 2")
    with pytest.raises(ValueError, match="newer than 1"):
        follower.update(1)
