"""The same batches on the FSDP2 trainer and on the Megatron trainer (TP 1 in this process;
on 2 gloo processes: TP 2 with sequence parallelism, PP 2, and Qwen3-MoE with EP 2 over two
data-parallel replicas with the distributed optimizer) give the same metrics (all of them),
gradients (in HF names; not with a sharded optimizer over replicas) and updated weights within
fp32 tolerances.

Every loss term is on (KL to a reference model, entropy bonus, a mismatch weight), two
mini-batches per step (a no-grad old-logprob pass, and a second update that sees the first)
and micro-batches of 2 samples with an odd batch (a short last micro-batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_testlib import run_workers, save_tiny, tiny_moe_config, tiny_qwen3_config
from _trainer_testlib import make_batch
from safetensors.torch import load_file

from miles_trainer import FSDPTrainer, LossConfig, MismatchConfig, TrainerConfig
from miles_trainer.megatron import MegatronConfig
from miles_trainer.megatron.convert import unstack_experts
from miles_trainer.megatron.trainer import MegatronTrainer

STEPS = [11, 12]
# Measured (README, "Megatron backend"): max |grad diff| / max |grad| over every tensor, max
# |param diff| after two lr 1e-3 steps, and metrics relative differences, Megatron vs FSDP2.
GRAD_RTOL = 1e-4
PARAM_ATOL = 5e-5
METRIC_RTOL = 1e-5
METRIC_ATOL = 1e-6  # loss terms are fp32 sums of O(1) values that partly cancel
TRAINER: dict[str, Any] = {
    "lr": 1e-3,
    "eps": 1e-6,  # see test_trainer_fsdp.EPS: Adam's first step amplifies tiny-gradient noise
    "grad_clip": None,
    "micro_batch_size": 2,
    "num_minibatches": 2,
}
LOSS: dict[str, Any] = {"loss_agg": "seq-mean-token-mean", "kl_coef": 0.05, "entropy_coef": 0.01}


def _loss() -> LossConfig:
    return LossConfig(**LOSS, mismatch=MismatchConfig(upper=2.0))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_qwen3_config(), tmp_path_factory.mktemp("mg-qwen3") / "model")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_moe_config(), tmp_path_factory.mktemp("mg-moe") / "model")


def _fsdp_run(model_dir: Path) -> dict[str, Any]:
    """Metrics, last mini-batch's gradients and final weights of the FSDP2 trainer (1 rank)."""
    trainer = FSDPTrainer(TrainerConfig(model_path=str(model_dir), loss=_loss(), **TRAINER))
    grads: dict[str, torch.Tensor] = {}
    for name, p in trainer.model.named_parameters():

        def keep(p: torch.Tensor, name: str = name) -> None:
            assert p.grad is not None
            grads[name] = p.grad.detach().clone()  # the last call holds the accumulated grad

        p.register_post_accumulate_grad_hook(keep)
    metrics = [trainer.train_step(make_batch(5, seed=s)) for s in STEPS]
    params = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
    final = dict(unstack_experts(params.items()))
    if trainer.model.config.tie_word_embeddings:  # type: ignore[union-attr]
        final.pop("lm_head.weight")
    return {"metrics": metrics, "grads": dict(unstack_experts(grads.items())), "params": final}


@pytest.fixture(scope="module")
def fsdp_dense(dense_dir: Path) -> dict[str, Any]:
    return _fsdp_run(dense_dir)


@pytest.fixture(scope="module")
def fsdp_moe(moe_dir: Path) -> dict[str, Any]:
    return _fsdp_run(moe_dir)


def _compare(got: dict[str, Any], want: dict[str, Any], model_dir: Path) -> None:
    for k, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        assert g.keys() == w.keys()  # the same metrics, every one of them
        for name in w:
            assert g[name] == pytest.approx(w[name], rel=METRIC_RTOL, abs=METRIC_ATOL), (k, name)
    if got["grads"] is None:  # several replicas with the distributed optimizer: no full grads
        got["grads"] = {}
        want = dict(want, grads={})
    assert got["grads"].keys() == want["grads"].keys()
    worst = 0.0
    for name, w in want["grads"].items():
        scale = w.abs().max().item()
        worst = max(worst, (got["grads"][name] - w).abs().max().item() / max(scale, 1e-12))
    print(f"max relative grad diff: {worst:.3g}")
    assert worst < GRAD_RTOL
    assert got["params"].keys() == want["params"].keys()
    diff = max((got["params"][n] - w).abs().max().item() for n, w in want["params"].items())
    print(f"max |param diff|: {diff:.3g}")
    assert diff < PARAM_ATOL
    from _megatron_testlib import checkpoint_state

    init = checkpoint_state(model_dir)
    moved = max((want["params"][n] - w).abs().max().item() for n, w in init.items())
    assert moved > 20 * PARAM_ATOL  # the weights did move: the comparison is not trivial


def _megatron_in_process(model_dir: Path) -> dict[str, Any]:
    cfg = TrainerConfig(
        model_path=str(model_dir),
        loss=_loss(),
        backend="megatron",
        megatron=MegatronConfig(),
        **TRAINER,
    )
    trainer = cfg.build()
    assert isinstance(trainer, MegatronTrainer)
    metrics = [trainer.train_step(make_batch(5, seed=s)) for s in STEPS]
    return {
        "metrics": metrics,
        "grads": dict(trainer.named_hf_grads()),
        "params": dict(trainer.named_hf_tensors()),
    }


def _megatron_workers(
    model_dir: Path, out: Path, megatron: dict[str, Any], *, nproc: int = 2
) -> dict[str, Any]:
    spec = {
        "megatron": megatron,
        "trainer": TRAINER,
        "loss": LOSS,
        "mismatch_upper": 2.0,
        "steps": STEPS,
    }
    result = run_workers(model_dir, out, spec, nproc=nproc)
    assert result["world"] == nproc
    grads = out / "grads.safetensors"
    return {
        "metrics": result["metrics"],
        "grads": load_file(str(grads)) if grads.exists() else None,
        "params": load_file(str(out / "params.safetensors")),
    }


def test_tp1_matches_fsdp(dense_dir: Path, fsdp_dense: dict[str, Any]) -> None:
    _compare(_megatron_in_process(dense_dir), fsdp_dense, dense_dir)


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_fsdp(
    dense_dir: Path, fsdp_dense: dict[str, Any], tmp_path: Path
) -> None:
    got = _megatron_workers(dense_dir, tmp_path, {"tp": 2, "sequence_parallel": True})
    _compare(got, fsdp_dense, dense_dir)


@pytest.mark.slow
def test_pp2_matches_fsdp(dense_dir: Path, fsdp_dense: dict[str, Any], tmp_path: Path) -> None:
    _compare(_megatron_workers(dense_dir, tmp_path, {"pp": 2}), fsdp_dense, dense_dir)


@pytest.mark.slow
def test_moe_ep2_dp2_matches_fsdp(moe_dir: Path, fsdp_moe: dict[str, Any], tmp_path: Path) -> None:
    # tp 1 x ep 2 on 2 ranks: two data-parallel replicas, experts split over them, the
    # distributed optimizer sharding the master weights and moments over the replicas.
    got = _megatron_workers(moe_dir, tmp_path, {"ep": 2})
    _compare(got, fsdp_moe, moe_dir)
