"""The Megatron backend's R3 and checkpoint/resume (``megatron/r3.py``, ``train_state.py``).

R3: on a Qwen3-MoE whose weights drifted from the rollout's, replay gives the same metrics as
on the FSDP2 trainer (so the same experts per token), in this process (TP 1) and with TP 2 x
EP 2 and sequence parallelism on 2 gloo processes (each TP rank routes its slice of the
sequence). Resume: a trainer stopped after step 2 and resumed from its checkpoint ends with
bit-identical parameters, optimizer state (fp32 masters, Adam moments, steps: compared through
a checkpoint of both at step 4), metrics and RNG draws, with megatron's distributed optimizer
and without it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_testlib import save_tiny, tiny_moe_config
from _r3_testlib import make_drifted, rollout_batch
from _trainer_testlib import make_batch
from safetensors.torch import load_file

from miles_trainer import FSDPTrainer, LossConfig, TrainerConfig
from miles_trainer.checkpoint import CheckpointError, export_hf
from miles_trainer.megatron import MegatronConfig
from miles_trainer.megatron.trainer import MegatronTrainer

HERE = Path(__file__).parent
METRIC_RTOL = 1e-5  # Megatron vs FSDP2 (test_megatron_parity's tolerance)


@pytest.fixture(scope="module")
def rollout_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_moe_config(), tmp_path_factory.mktemp("mg-r3") / "rollout")


@pytest.fixture(scope="module")
def drifted_dir(rollout_dir: Path) -> Path:
    return make_drifted(rollout_dir, rollout_dir.parent / "drifted")


@pytest.fixture(scope="module")
def fsdp_r3(rollout_dir: Path, drifted_dir: Path) -> dict[bool, dict[str, float]]:
    """The FSDP2 trainer's metrics on the rollout batch, with and without replay."""
    batch = rollout_batch(rollout_dir)
    return {
        r3: FSDPTrainer(TrainerConfig(model_path=str(drifted_dir), r3=r3, lr=1e-3)).train_step(
            batch
        )
        for r3 in (False, True)
    }


def _assert_close_metrics(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=METRIC_RTOL, abs=1e-6), k


def test_megatron_r3_matches_fsdp(
    rollout_dir: Path, drifted_dir: Path, fsdp_r3: dict[bool, dict[str, float]]
) -> None:
    batch = rollout_batch(rollout_dir)
    for r3 in (False, True):
        cfg = TrainerConfig(model_path=str(drifted_dir), r3=r3, lr=1e-3)
        got = MegatronTrainer(cfg).train_step(batch)
        _assert_close_metrics(got, fsdp_r3[r3])
    assert fsdp_r3[True]["r3_expert_match"] == 1.0
    assert fsdp_r3[False]["r3_expert_match"] < 0.99


def _same_tree(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_training_state(a: Path, b: Path) -> None:
    """Two checkpoints hold the same model and optimizer files, bit for bit."""
    names = sorted(p.name for p in (a / "megatron").iterdir())
    assert names == sorted(p.name for p in (b / "megatron").iterdir())
    assert any(n.startswith("optim_rank") for n in names)
    for name in names:
        _same_tree(
            torch.load(a / "megatron" / name, weights_only=False),
            torch.load(b / "megatron" / name, weights_only=False),
            name,
        )


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_megatron_resume_is_bit_exact(
    drifted_dir: Path, tmp_path: Path, distributed_optimizer: bool
) -> None:
    """Qwen3-MoE, KL to a reference, two mini-batches of 2-sample micro-batches per step."""
    cfg = TrainerConfig(
        model_path=str(drifted_dir),
        lr=1e-3,
        eps=1e-6,
        micro_batch_size=2,
        num_minibatches=2,
        loss=LossConfig(kl_coef=0.05),
        megatron=MegatronConfig(distributed_optimizer=distributed_optimizer),
    )
    batches = [make_batch(5, seed=s) for s in (1, 2, 3, 4)]
    whole = MegatronTrainer(cfg)
    want = [whole.train_step(b) for b in batches]
    whole.save_checkpoint(tmp_path / "whole", step=4)
    first = MegatronTrainer(cfg)
    for b in batches[:2]:
        first.train_step(b)
    first.save_checkpoint(tmp_path / "ckpt", step=2, client_state=[1, 2])
    draws = (torch.rand(3), random.random())
    torch.manual_seed(7)
    random.seed(7)
    resumed = MegatronTrainer(cfg)
    info = resumed.load_checkpoint(tmp_path / "ckpt")
    assert (info.step, info.client_state, info.backend) == (2, [1, 2], "megatron")
    again = (torch.rand(3), random.random())
    assert torch.equal(draws[0], again[0])
    assert draws[1] == again[1]
    assert [resumed.train_step(b) for b in batches[2:]] == want[2:]
    resumed.save_checkpoint(tmp_path / "resumed", step=4)
    assert_same_training_state(tmp_path / "whole", tmp_path / "resumed")


def test_megatron_refusals_and_export(drifted_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(model_path=str(drifted_dir), lr=1e-3)
    trainer = MegatronTrainer(cfg)
    trainer.train_step(make_batch(5, seed=1))
    trainer.save_checkpoint(tmp_path / "ckpt", step=1)
    trainer.save_hf_checkpoint(tmp_path / "hf")
    export_hf(tmp_path / "ckpt", tmp_path / "exported")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    got = load_file(tmp_path / "exported" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)

    FSDPTrainer(cfg).save_checkpoint(tmp_path / "fsdp", step=0)
    with pytest.raises(
        CheckpointError, match="written by the fsdp backend; this trainer is megatron"
    ):
        trainer.load_checkpoint(tmp_path / "fsdp")
    other = TrainerConfig(
        model_path=str(drifted_dir), megatron=MegatronConfig(distributed_optimizer=False)
    )
    with pytest.raises(CheckpointError, match="distributed_optimizer: checkpoint True, now False"):
        MegatronTrainer(other).load_checkpoint(tmp_path / "ckpt")


@pytest.mark.slow
def test_megatron_tp2_ep2_r3_and_resume(
    rollout_dir: Path, drifted_dir: Path, tmp_path: Path, fsdp_r3: dict[bool, dict[str, float]]
) -> None:
    layout = {"tp": 2, "ep": 2, "sequence_parallel": True}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += ["2", str(HERE / "_megatron_resume_worker.py"), str(rollout_dir), str(drifted_dir)]
    cmd += [str(tmp_path), json.dumps(layout)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    _assert_close_metrics(json.loads((tmp_path / "r3-metrics.json").read_text()), fsdp_r3[True])
    runs = json.loads((tmp_path / "resume-metrics.json").read_text())
    assert runs["got"] == runs["want"]
    assert_same_training_state(tmp_path / "whole", tmp_path / "resumed")
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rng-rank{rank}.pt")
        again = torch.load(tmp_path / f"rng-resumed-rank{rank}.pt")
        assert torch.equal(saved[0], again[0])
        assert saved[1] == again[1]
