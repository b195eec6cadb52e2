"""``transfer.method`` in a recipe: validation naming the key, and the factory's choice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.config import load_recipe
from miles.weight_sync import DeltaSync, P2PSync, PushSync, build_weight_sync


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("transfer.method=rsync", "transfer.method must be one of ['push', 'p2p', 'delta']"),
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


def test_methods_that_cannot_run_are_refused_before_the_run() -> None:
    cfg = load_recipe("arith-tiny", ["transfer.method=delta"])
    with pytest.raises(ValueError, match=r"transfer\.delta\.dir"):
        build_weight_sync(cfg, None)
    cfg = load_recipe("arith-tiny", ["transfer.method=p2p", "trainer.backend=megatron"])
    with pytest.raises(ValueError, match=r"use transfer\.method push or delta"):
        build_weight_sync(cfg, None)
