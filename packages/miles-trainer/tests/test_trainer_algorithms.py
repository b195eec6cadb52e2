"""Each algorithm of the README's table, selected by config alone, trains a real tiny Qwen3:
GRPO, Dr. GRPO, DAPO, GSPO, REINFORCE++ (with and without baseline), RLOO and PPO with a critic
(GAE); plus the reference model kept on the CPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_testlib import full_params, multiturn_batch

from miles_trainer import (
    AdvantageConfig,
    CriticConfig,
    FSDPTrainer,
    LossConfig,
    MismatchConfig,
    OverlongConfig,
    ReferenceConfig,
    TrainerConfig,
)

# The recipe settings of each algorithm (README, "Algorithms").
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {
        "advantage": AdvantageConfig(estimator="grpo"),
        "loss": LossConfig(loss_agg="seq-mean-token-mean", clip_high=0.2, kl_coef=0.01),
    },
    "dr_grpo": {
        "advantage": AdvantageConfig(estimator="dr_grpo"),
        "loss": LossConfig(loss_agg="seq-mean-token-sum-norm", clip_high=0.2),
    },
    "dapo": {
        "advantage": AdvantageConfig(
            estimator="grpo",
            group_filter="nonzero_std",
            overlong=OverlongConfig(max_length=16, buffer_length=6),
        ),
        "loss": LossConfig(loss_agg="token-mean", clip_low=0.2, clip_high=0.28),
    },
    "gspo": {
        "advantage": AdvantageConfig(estimator="grpo"),
        "loss": LossConfig(
            name="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"
        ),
    },
    "reinforce_pp": {
        "advantage": AdvantageConfig(estimator="reinforce_pp"),
        "loss": LossConfig(kl_coef=0.01, kl_type="k2"),
    },
    "reinforce_pp_baseline": {
        "advantage": AdvantageConfig(estimator="reinforce_pp_baseline"),
        "loss": LossConfig(kl_coef=0.01, kl_type="low_var_kl"),
    },
    "rloo": {"advantage": AdvantageConfig(estimator="rloo"), "loss": LossConfig()},
    "ppo": {
        "advantage": AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95, whiten=True),
        "loss": LossConfig(mismatch=MismatchConfig(level="token", upper=2.0)),
        "critic": CriticConfig(lr=1e-3),
    },
}


def _cfg(model_dir: Path, **kw: Any) -> TrainerConfig:
    base: dict[str, Any] = {
        "model_path": str(model_dir),
        "lr": 1e-3,
        "eps": 1e-6,
        "micro_batch_size": 4,
        "num_minibatches": 2,
    }
    base.update(kw)
    return TrainerConfig(**base)


@pytest.mark.parametrize("algo", sorted(PRESETS))
def test_each_algorithm_trains_from_config(tiny_model_dir: Path, algo: str) -> None:
    batch = multiturn_batch(8, seed=11)
    # group 0 has no signal (DAPO's filter drops it); the others do
    batch.rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    trainer = FSDPTrainer(_cfg(tiny_model_dir, **PRESETS[algo]))
    before = full_params(trainer.model)
    metrics = trainer.train_step(batch)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["optimizer_steps"] == 2.0
    assert metrics["advantage_abs_mean"] > 0
    moved = max((full_params(trainer.model)[k] - v).abs().max().item() for k, v in before.items())
    assert moved > 1e-5
    if algo == "dapo":  # responses of 10 .. 11 tokens: only the 11-token one is penalised
        assert metrics["groups_filtered"] == 1.0
        assert metrics["samples"] == 6.0
        assert metrics["overlong_penalty_mean"] == pytest.approx(-1 / 6 / 8)
    if algo == "gspo":  # the sequence ratios leave GSPO's tiny clip range after one step
        assert metrics["clip_frac"] > 0
    if PRESETS[algo]["loss"].kl_coef > 0:
        assert metrics["kl"] > 0  # the second mini-batch's policy has moved from the reference


def test_ppo_critic_learns_the_returns(tiny_model_dir: Path) -> None:
    """GAE with gamma = lam = 1 makes every trained token's return the sample's reward: the
    critic's value loss falls over repeated steps, and its head leaves zero."""
    batch = multiturn_batch(6, seed=12)
    cfg = _cfg(
        tiny_model_dir,
        num_minibatches=1,
        advantage=AdvantageConfig(estimator="gae"),
        critic=CriticConfig(lr=3e-3, value_clip=None),
    )
    trainer = FSDPTrainer(cfg)
    assert trainer.critic is not None
    losses = []
    for step in range(5):
        metrics = trainer.train_step(batch)
        losses.append(metrics["value_loss"])
        if step == 0:  # zero head: values 0, returns = rewards
            assert metrics["values_mean"] == 0.0
            rewards = batch.rewards or []
            want = (
                sum(r * sum(m) for r, m in zip(rewards, batch.loss_masks)) / batch.num_loss_tokens()
            )
            assert metrics["returns_mean"] == pytest.approx(want, rel=1e-6)
            assert metrics["critic_grad_norm"] > 0
    # measured: 0.190, 0.161, 0.107, 0.058, 0.023
    assert losses[-1] < 0.5 * losses[0], losses
    assert trainer.critic.get_parameter("value_head.weight").abs().max().item() > 0
    state = trainer.state_dict()
    assert {"critic", "critic_optimizer"} <= set(state)


def test_gae_without_critic_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="needs a critic"):
        TrainerConfig(model_path="/m", advantage=AdvantageConfig(estimator="gae"))
    with pytest.raises(ValueError, match="does not use values"):
        TrainerConfig(model_path="/m", critic=CriticConfig())


def test_reference_on_the_cpu(tiny_model_dir: Path) -> None:
    """placement "cpu": a plain full copy in host memory (here the device is the CPU too, so
    the numbers must be the same as the device placement's)."""
    batch = multiturn_batch(4, seed=13)
    loss = LossConfig(kl_coef=0.1)
    results = []
    for placement in ("device", "cpu"):
        trainer = FSDPTrainer(
            _cfg(tiny_model_dir, loss=loss, reference=ReferenceConfig(placement=placement))
        )
        assert trainer._ref is not None
        assert next(trainer._ref.module.parameters()).device == torch.device("cpu")
        results.append(trainer.train_step(batch))
    assert results[0] == results[1]
    assert results[0]["kl"] > 0
