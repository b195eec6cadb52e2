"""Config and TrainBatch validation: every user mistake is a ValueError that says what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles_trainer import (
    FSDPTrainer,
    LossConfig,
    MismatchConfig,
    TrainBatch,
    Trainer,
    TrainerConfig,
)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_type": "k4"}, "kl_type"),
        ({"entropy_coef": -0.01}, "entropy_coef"),
        ({"loss_agg": "seq-sum"}, "loss_agg"),
        ({"name": "grpo"}, "name must be one of"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"norm_length": 0}, "norm_length"),
        ({"mismatch": MismatchConfig(), "use_rollout_logprobs": True}, "needs use_rollout_"),
    ],
)
def test_loss_config_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_path": ""}, "model_path"),
        ({"dtype": "fp8"}, "dtype"),
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": 0.0}, "eps"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"num_minibatches": 0}, "num_minibatches"),
        ({"temperature": 0.0}, "temperature"),
        ({"backend": "deepspeed"}, "backend must be one of"),
    ],
)
def test_trainer_config_rejects(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"model_path": "/some/model"}
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**base)


def test_defaults_are_the_documented_ones() -> None:
    cfg = TrainerConfig(model_path="/m")
    assert (cfg.lr, cfg.micro_batch_size, cfg.num_minibatches, cfg.temperature) == (
        1e-5,
        8,
        1,
        1.0,
    )
    assert (cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.kl_type) == (0.2, 0.28, "k3")
    assert cfg.loss.loss_agg == "token-mean"
    assert cfg.loss.mismatch is None
    assert (cfg.loss.name, cfg.advantage.estimator, cfg.backend) == ("ppo", "grpo", "fsdp")


def _good() -> dict[str, Any]:
    return {
        "tokens": [[1, 2, 3, 4], [5, 6, 7]],
        "response_lengths": [2, 1],
        "loss_masks": [[1, 0], [1]],
        "rollout_logprobs": [[-0.1, -0.2], [-0.3]],
        "advantages": [[1.0, 1.0], [-1.0]],
    }


def test_good_batch() -> None:
    b = TrainBatch(**_good())
    assert len(b) == 2
    assert b.num_loss_tokens() == 2


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("response_lengths", [2, 3], r"sample 1: response_length 3 must be in \[0, "),
        ("loss_masks", [[1, 0], [1, 1]], r"sample 1: len\(loss_masks\[1\]\) = 2"),
        ("rollout_logprobs", [[-0.1], [-0.3]], r"sample 0: len\(rollout_logprobs\[0\]\) = 1"),
        ("advantages", [[1.0, 1.0]], "advantages has 1 entries, tokens has 2"),
        ("loss_masks", [[1, 2], [1]], r"sample 0: loss_masks\[0\] must hold only 0 and 1"),
        ("advantages", [[1.0, float("nan")], [1.0]], r"sample 0: advantages\[0\] .*non-finite"),
        ("tokens", [[1, 2, 3, 4], [5, -6, 7]], r"sample 1: tokens\[1\] holds a negative"),
    ],
)
def test_bad_batch_names_the_sample(field: str, value: Any, match: str) -> None:
    kwargs = _good()
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        TrainBatch(**kwargs)


def test_empty_batch_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        TrainBatch(
            tokens=[], response_lengths=[], loss_masks=[], rollout_logprobs=[], advantages=[]
        )


def test_build_makes_the_backend_trainer(tiny_model_dir: Path) -> None:
    trainer = TrainerConfig(model_path=str(tiny_model_dir), micro_batch_size=2).build()
    assert isinstance(trainer, FSDPTrainer)
    assert isinstance(trainer, Trainer)  # the protocol the loop relies on
