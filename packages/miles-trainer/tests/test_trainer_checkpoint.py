"""Checkpoint and resume on the FSDP2 backend: a trainer stopped after step k and resumed from
its checkpoint ends bit-identical (weights, optimizer state, critic, metrics, RNG draws) to the
uninterrupted one, on one rank (with a critic; with NVMe optimizer offload) and on two gloo
ranks; torn, foreign and other-model checkpoints are refused with nothing changed; retention;
HF export equals `save_hf_checkpoint`."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_testlib import save_tiny, tiny_qwen3_config
from _trainer_testlib import (
    full_params,
    make_batch,
    multiturn_batch,
    multiturn_config,
    scenario_config,
)
from safetensors.torch import load_file

from miles_trainer import FSDPTrainer, OffloadConfig, TrainerConfig
from miles_trainer.checkpoint import (
    CheckpointError,
    export_hf,
    latest_checkpoint,
    main,
    prune_checkpoints,
    read_meta,
)

HERE = Path(__file__).parent


def _optimizer_state(trainer: FSDPTrainer, key: str = "optimizer") -> dict[str, Any]:
    state: dict[str, Any] = trainer.state_dict()[key]["state"]
    return state


def assert_same_state(a: FSDPTrainer, b: FSDPTrainer) -> None:
    """Parameters and optimizer state (policy, and critic when present) bit for bit."""
    pa, pb = full_params(a.model), full_params(b.model)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa), [
        k for k in pa if not torch.equal(pa[k], pb[k])
    ]
    keys = ["optimizer"] + (["critic_optimizer"] if a.critic is not None else [])
    for key in keys:
        sa, sb = _optimizer_state(a, key), _optimizer_state(b, key)
        assert sa.keys() == sb.keys()
        assert sa
        for fqn, entry in sa.items():
            for name, value in entry.items():
                assert torch.equal(value, sb[fqn][name]), (key, fqn, name)
    if a.critic is not None:
        assert b.critic is not None
        ca, cb = full_params(a.critic), full_params(b.critic)
        assert all(torch.equal(ca[k], cb[k]) for k in ca)


def _stop_and_resume(
    make_cfg: Callable[[str], TrainerConfig], batches: list[Any], k: int, ckpt: Path
) -> None:
    """``make_cfg(name)``: the config of trainer ``name`` ("whole", "first", "resumed")."""
    whole = FSDPTrainer(make_cfg("whole"))
    want = [whole.train_step(b) for b in batches]
    first = FSDPTrainer(make_cfg("first"))
    for b in batches[:k]:
        first.train_step(b)
    first.save_checkpoint(ckpt, step=k, client_state={"data_position": 3 * k})
    draws = (torch.rand(3), random.random())
    del first
    torch.manual_seed(99)  # another process would start from other RNG states
    random.seed(99)
    resumed = FSDPTrainer(make_cfg("resumed"))
    info = resumed.load_checkpoint(ckpt)
    assert (info.step, info.client_state, info.backend) == (k, {"data_position": 3 * k}, "fsdp")
    again = (torch.rand(3), random.random())
    assert torch.equal(draws[0], again[0])
    assert draws[1] == again[1]
    assert [resumed.train_step(b) for b in batches[k:]] == want[k:]
    assert_same_state(whole, resumed)


def test_resume_with_critic_is_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    """PPO with a critic, reference on the CPU, packed multi-turn batches, two mini-batches."""
    batches = [multiturn_batch(7, seed=s) for s in (21, 22, 23)]
    cfg = multiturn_config(str(tiny_model_dir))
    _stop_and_resume(lambda _: cfg, batches, 1, tmp_path / "ckpt")
    meta = read_meta(tmp_path / "ckpt")
    assert meta["parts"] == ["critic", "model"]
    assert meta["step"] == 1
    assert meta["hf_skip"] == ["lm_head.weight"]  # tied to the embedding


def test_resume_with_nvme_offload_is_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("miles_offload")
    base = scenario_config(str(tiny_model_dir))

    def make_cfg(name: str) -> TrainerConfig:  # one state directory per optimizer (its lock)
        offload = OffloadConfig(mode="nvme", path=str(tmp_path / name), bucket_mb=0.05)
        return dataclasses.replace(base, offload=offload)

    batches = [make_batch(5, seed=s) for s in (1, 2, 3)]
    _stop_and_resume(make_cfg, batches, 2, tmp_path / "ckpt")


@pytest.mark.slow
def test_two_ranks_resume_is_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += ["2", str(HERE / "_trainer_resume_worker.py"), str(tiny_model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want, got = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.load(tmp_path / "full-metrics.pt")[2:] == torch.load(
        tmp_path / "resumed-metrics.pt"
    )
    for rank in (0, 1):
        w, g = (
            torch.load(tmp_path / f"full-rank{rank}.pt"),
            torch.load(tmp_path / f"resumed-rank{rank}.pt"),
        )
        assert w
        assert g.keys() == w.keys()
        for fqn, entry in w.items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(g[fqn][name], entry[name]), (rank, fqn, name)
        saved = torch.load(tmp_path / f"rng-rank{rank}.pt")
        again = torch.load(tmp_path / f"rng-resumed-rank{rank}.pt")
        assert torch.equal(saved[0], again[0])
        assert saved[1] == again[1]
    # Two ranks' shards do not load into one rank: the error names the world size.
    one = FSDPTrainer(scenario_config(str(tiny_model_dir)))
    with pytest.raises(
        CheckpointError, match=r"another layout \(world_size: checkpoint 2, now 1\)"
    ):
        one.load_checkpoint(tmp_path / "ckpt")


def test_refuses_torn_foreign_and_other_model_checkpoints(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = scenario_config(str(tiny_model_dir))
    trainer = FSDPTrainer(cfg)
    trainer.train_step(make_batch(5, seed=1))
    good = tmp_path / "good"
    trainer.save_checkpoint(good, step=1)
    before = full_params(trainer.model)

    def refused(path: Path, match: str, into: FSDPTrainer = trainer) -> None:
        with pytest.raises(CheckpointError, match=match):
            into.load_checkpoint(path)

    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "fsdp").mkdir()
    refused(torn, "has no meta.json: it is torn")
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    shard = next((cut / "fsdp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    refused(cut, r"is torn: fsdp/__0_0.distcp has \d+ bytes, \d+ were written")
    (cut / "meta.json").write_text(json.dumps({"format": "something-else"}))
    refused(cut, "is not a miles-trainer checkpoint")

    other_dir = save_tiny(_wider(), tmp_path / "other")
    other = FSDPTrainer(dataclasses.replace(cfg, model_path=str(other_dir)))
    other.train_step(make_batch(5, seed=1))
    other.save_checkpoint(tmp_path / "other_ckpt", step=1)
    refused(tmp_path / "other_ckpt", r"another model \(hidden_size: checkpoint 96, model 64")

    critic_cfg = multiturn_config(str(tiny_model_dir))
    with_critic = FSDPTrainer(critic_cfg)
    with_critic.save_checkpoint(tmp_path / "critic_ckpt", step=0)
    refused(tmp_path / "critic_ckpt", r"holds \['critic', 'model'\], this trainer has \['model'\]")
    after = full_params(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded


def _wider() -> Any:
    config = tiny_qwen3_config()
    config.hidden_size = 96
    return config


def test_retention_latest_and_failed_save(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = FSDPTrainer(scenario_config(str(tiny_model_dir)))
    root = tmp_path / "ckpts"
    for step in (1, 2, 3, 4):
        trainer.save_checkpoint(root / f"step_{step:06d}", step=step)
    (root / "hf_final").mkdir()  # not a trainer checkpoint: never touched
    (root / ".step_000005.tmp-abc").mkdir()  # a write that died
    gone = prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in gone) == ["step_000001", "step_000002"]
    assert sorted(p.name for p in root.iterdir()) == ["hf_final", "step_000003", "step_000004"]
    (root / "step_000004" / "meta.json").unlink()  # torn newest: skipped
    assert latest_checkpoint(root) == root / "step_000003"
    # A save that fails (an unpicklable client state) leaves the old checkpoint and no temp.
    with pytest.raises(Exception, match="pickle"):
        trainer.save_checkpoint(root / "step_000003", step=5, client_state=lambda: 0)
    assert read_meta(root / "step_000003")["step"] == 3
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_export_hf_equals_save_hf_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = FSDPTrainer(scenario_config(str(tiny_model_dir)))
    trainer.train_step(make_batch(5, seed=1))
    trainer.save_checkpoint(tmp_path / "ckpt", step=1)
    trainer.save_hf_checkpoint(tmp_path / "hf", dtype="bfloat16")
    main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "exported"), "--dtype", "bfloat16"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "exported")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    got = load_file(tmp_path / "exported" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "exported" / name).read_text() == (tmp_path / "hf" / name).read_text()
    export_hf(tmp_path / "ckpt", tmp_path / "fp32")  # default: the trainer's compute dtype
    assert (
        load_file(tmp_path / "fp32" / "model.safetensors")["model.norm.weight"].dtype
        == torch.float32
    )


def test_deterministic_turns_on_deterministic_kernels(tiny_model_dir: Path) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        cfg = dataclasses.replace(scenario_config(str(tiny_model_dir)), deterministic=True)
        FSDPTrainer(cfg).train_step(make_batch(5, seed=1))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_full_disk_under_torch_checkpoint_is_reported_as_enospc(tmp_path: Path) -> None:
    """torch.save's zip writer turns ENOSPC into RuntimeError('unexpected pos ...'), and
    torch.distributed.checkpoint wraps that per rank; the writer gives it back as OSError(ENOSPC)
    naming the directory (the real case, on a full tmpfs: tools/reliability_table.py full-disk)."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from miles_trainer.checkpoint import _disk_full_as_oserror

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("save", {0: (short, None)})
    out = tmp_path / "trainer" / "step_000002"
    for raised in (short, wrapped):
        err = _disk_full_as_oserror(raised, tmp_path, out)
        assert isinstance(err, OSError)
        assert err.errno == errno.ENOSPC
        assert str(tmp_path / "trainer") in str(err)
        assert err.__cause__ is raised
    other = RuntimeError("CUDA error: an illegal memory access")
    assert _disk_full_as_oserror(other, tmp_path, out) is other
    interrupt = KeyboardInterrupt()
    assert _disk_full_as_oserror(interrupt, tmp_path, out) is interrupt
