"""TrainerConfig.offload: optimizer state in CPU memory or on NVMe (miles-offload) gives the same
parameters and optimizer state as torch's AdamW, bit for bit, on one rank and on two FSDP2
ranks (gloo, torchrun), including a state_dict round trip."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _trainer_testlib import full_params, run_scenario, scenario_config

from miles_trainer import FSDPTrainer, OffloadConfig, TrainerConfig

HERE = Path(__file__).parent


def test_offload_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"OffloadConfig\.mode must be one of"):
        OffloadConfig(mode="disk")
    with pytest.raises(ValueError, match="needs path"):
        OffloadConfig(mode="nvme")
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        OffloadConfig(mode="cpu", bucket_mb=0)
    assert TrainerConfig(model_path="m").offload.mode == "none"


def test_missing_miles_offload_names_the_install(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "miles_offload", None)  # import fails like a missing package
    cfg = dataclasses.replace(
        scenario_config(str(tiny_model_dir)), offload=OffloadConfig(mode="cpu")
    )
    with pytest.raises(ImportError, match=r"pip install miles-offload"):
        FSDPTrainer(cfg)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_one_rank_offload_is_bit_exact(tiny_model_dir: Path, tmp_path: Path, offload: str) -> None:
    pytest.importorskip("miles_offload")
    base = scenario_config(str(tiny_model_dir))
    want_trainer = FSDPTrainer(base)
    want_metrics = run_scenario(want_trainer)
    cfg = dataclasses.replace(
        base, offload=OffloadConfig(mode=offload, path=str(tmp_path), bucket_mb=0.05)
    )
    trainer = FSDPTrainer(cfg)
    assert type(trainer._optimizer).__module__.startswith("miles_offload")
    assert run_scenario(trainer) == want_metrics
    want, got = full_params(want_trainer.model), full_params(trainer.model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_two_ranks_nvme_offload_is_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("miles_offload")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_trainer_offload_worker.py"),
        str(tiny_model_dir),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want, got = torch.load(tmp_path / "none.pt"), torch.load(tmp_path / "nvme.pt")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert (tmp_path / "state" / "rank0" / "manifest.json").exists()
    assert (tmp_path / "state" / "rank1" / "manifest.json").exists()
    for rank in (0, 1):
        w = torch.load(tmp_path / f"none-rank{rank}.pt")
        g = torch.load(tmp_path / f"nvme-rank{rank}.pt")
        assert w
        assert g.keys() == w.keys()
        for fqn, entry in w.items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(g[fqn][name], entry[name]), (rank, fqn, name)
