"""Two FSDP2 ranks (gloo, torchrun) give the same update as one (plain-module) rank, in float32
and in bfloat16 compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from _trainer_testlib import (
    full_params,
    multiturn_config,
    run_multiturn_scenario,
    run_scenario,
    scenario_config,
)

from miles_trainer import FSDPTrainer

HERE = Path(__file__).parent
# Measured (README): max |param diff| 1 vs 2 ranks after two lr=1e-3 steps; metrics rel diff.
PARAM_ATOL = 2e-5
METRIC_RTOL = 1e-5


def test_two_ranks_match_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_trainer_dist_worker.py"),
        str(tiny_model_dir),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    one = FSDPTrainer(scenario_config(str(tiny_model_dir)))
    want_metrics = run_scenario(one)
    want = full_params(one.model)

    from transformers import AutoModelForCausalLM

    two = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    got = {k: v.detach() for k, v in two.named_parameters()}
    assert got.keys() == want.keys()
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"max |param diff| 1 vs 2 ranks: {diff:.3g}")
    assert diff < PARAM_ATOL
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = max((want[k] - p.detach()).abs().max().item() for k, p in init.named_parameters())
    assert moved > 100 * PARAM_ATOL  # the comparison is not trivially true

    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["world_size"] == 2
        assert "different batches on different ranks" in record["mismatch"]
        _check_metrics(record["metrics"], want_metrics, rank)

    # bfloat16 compute: FSDP2 mixed precision on 2 ranks, the trainer's own on 1 rank.
    one_bf16 = FSDPTrainer(scenario_config(str(tiny_model_dir), "bfloat16"))
    want_metrics_bf16 = run_scenario(one_bf16)
    want_bf16 = full_params(one_bf16.model)
    two_bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt-bf16", dtype=torch.float32)
    got_bf16 = {k: v.detach() for k, v in two_bf16.named_parameters()}
    diff = max((got_bf16[k] - want_bf16[k]).abs().max().item() for k in want_bf16)
    print(f"max |param diff| 1 vs 2 ranks, bfloat16 compute: {diff:.3g}")
    assert diff < PARAM_ATOL
    # ... and it is not the float32 result.
    assert max((want_bf16[k] - want[k]).abs().max().item() for k in want) > 100 * PARAM_ATOL
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}-bf16.json").read_text())
        _check_metrics(record["metrics"], want_metrics_bf16, rank)

    # Multi-turn: packed micro-batches by token budget, PPO critic, reference on the CPU.
    one_mt = FSDPTrainer(multiturn_config(str(tiny_model_dir)))
    want_metrics_mt = run_multiturn_scenario(one_mt)
    assert one_mt.critic is not None
    want_mt = {"policy": full_params(one_mt.model), "critic": full_params(one_mt.critic)}
    got_mt = torch.load(tmp_path / "multiturn.pt")
    for part in ("policy", "critic"):
        diff = max((got_mt[part][k] - v).abs().max().item() for k, v in want_mt[part].items())
        print(f"max |{part} param diff| 1 vs 2 ranks, multi-turn: {diff:.3g}")
        assert diff < PARAM_ATOL
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}-multiturn.json").read_text())
        _check_metrics(record["metrics"], want_metrics_mt, rank)


def _check_metrics(got: list[dict[str, float]], want: list[dict[str, float]], rank: int) -> None:
    assert len(got) == len(want)
    for step_got, step_want in zip(got, want):
        for key, value in step_want.items():
            tol = METRIC_RTOL * max(1.0, abs(value))
            assert abs(step_got[key] - value) <= tol, (rank, key, step_got[key], value)


EXIT_PROBE = """
import atexit, sys
import torch.distributed as dist
# Registered before the trainer's handler, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("at exit, initialized:", dist.is_initialized(), flush=True))
if sys.argv[2] == "own":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from miles_trainer import FSDPTrainer, TrainerConfig
FSDPTrainer(TrainerConfig(model_path=sys.argv[1]))
print("after the trainer, initialized:", dist.is_initialized(), flush=True)
from miles_trainer._gloo_exit import _gloo_workers, wait_for_gloo_workers
print("gloo workers:", len(_gloo_workers()), flush=True)
print("parked:", wait_for_gloo_workers(30.0), flush=True)
"""


def test_process_group_made_by_the_trainer_is_destroyed_at_exit(tiny_model_dir: Path) -> None:
    """A gloo worker thread freeing tensors during interpreter teardown aborts the process
    (SIGABRT, "terminate called without an active exception"; seen in CI in the 2-rank QAT run):
    the group the trainer created is destroyed by an atexit handler once gloo's worker threads
    (found under their thread name) have parked; a group the caller made is left alone."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    outs = {}
    for who in ("trainer", "own"):
        cmd = [sys.executable, "-c", EXIT_PROBE, str(tiny_model_dir), who]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outs[who] = proc.stdout
    assert "after the trainer, initialized: True" in outs["trainer"]
    assert "at exit, initialized: False" in outs["trainer"]
    for out in outs.values():
        workers = int(out.split("gloo workers:")[1].split()[0])
        assert workers > 0, out
        assert "parked: True" in out, out
    assert "at exit, initialized: True" in outs["own"]
