"""The learning-rate schedule: its shape, that each backend steps with exactly the scheduled
rate, and that a checkpoint or state dict carries the schedule's position."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_testlib import full_params, make_batch

from miles_trainer import TrainerConfig


def _cfg(**kw: Any) -> TrainerConfig:
    return TrainerConfig(model_path="unused", lr=1e-3, **kw)


def test_warmup_then_linear_and_cosine_decay() -> None:
    lin = _cfg(lr_warmup_steps=4, lr_decay_style="linear", lr_decay_steps=10, min_lr=1e-4)
    assert [lin.lr_at(s) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lin.lr_at(4) == pytest.approx(1e-3)
    assert lin.lr_at(9) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lin.lr_at(14) == pytest.approx(1e-4)
    assert lin.lr_at(1000) == pytest.approx(1e-4)  # stays at min_lr after the decay
    cos = _cfg(lr_decay_style="cosine", lr_decay_steps=8)
    assert cos.lr_at(0) == pytest.approx(1e-3)
    assert cos.lr_at(4) == pytest.approx(0.5e-3)
    assert cos.lr_at(2) == pytest.approx(0.5e-3 * (1 + math.cos(math.pi / 4)))
    assert cos.lr_at(8) == pytest.approx(0.0)
    const = _cfg(lr_warmup_steps=2)
    assert [const.lr_at(s) for s in range(4)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    assert _cfg().lr_at(10**6) == 1e-3


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"lr_warmup_steps": -1}, "lr_warmup_steps must be >= 0"),
        ({"lr_decay_style": "step"}, "lr_decay_style must be one of"),
        ({"lr_decay_steps": 0}, "lr_decay_steps must be None or >= 1"),
        ({"min_lr": 2e-3}, r"min_lr must be in \[0, lr=0.001\]"),
    ],
)
def test_bad_schedules_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def test_a_decay_without_its_length_says_what_to_set() -> None:
    with pytest.raises(ValueError, match=r"needs trainer\.lr_decay_steps"):
        _cfg(lr_decay_style="linear").lr_at(0)


@pytest.fixture(params=["fsdp", "megatron"])
def backend_model(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory) -> tuple:
    if request.param == "fsdp":
        return "fsdp", tiny_model_dir
    pytest.importorskip("megatron.core")
    from _megatron_testlib import save_tiny, tiny_qwen3_config

    return "megatron", save_tiny(tiny_qwen3_config(), tmp_path_factory.mktemp("mg-lr") / "model")


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    if hasattr(trainer, "named_hf_tensors"):
        return {n: t.clone() for n, t in trainer.named_hf_tensors()}
    return full_params(trainer.model)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_step_uses_the_scheduled_rate_and_resume_keeps_its_place(
    backend_model: tuple, tmp_path: Path
) -> None:
    """Linear decay 1e-3 -> 0 over 2 steps. Step 2 equals a constant-5e-4 trainer's step from
    the same state, bit for bit; step 3 (lr 0) changes nothing; trainers resumed after step 1
    (from the checkpoint, from the state dict) take step 2 at 5e-4 again."""
    backend, model_dir = backend_model
    batches = [make_batch(4, seed=s) for s in (11, 12, 13)]

    def trainer(**kw: Any) -> Any:
        return TrainerConfig(
            model_path=str(model_dir), backend=backend, eps=1e-6, micro_batch_size=2, **kw
        ).build()

    sched = {"lr": 1e-3, "lr_decay_style": "linear", "lr_decay_steps": 2}
    a = trainer(**sched)
    assert a.train_step(batches[0])["lr"] == pytest.approx(1e-3)
    a.save_checkpoint(tmp_path / "ckpt", step=1)
    from_state = trainer(**sched)
    from_state.load_state_dict(a.state_dict())  # copied now: FSDP2's state dict is a's own
    assert a.train_step(batches[1])["lr"] == pytest.approx(5e-4)
    after_two = _weights(a)
    assert a.train_step(batches[2])["lr"] == 0.0
    assert _equal(_weights(a), after_two)  # lr 0: AdamW leaves every weight as it was

    constant = trainer(lr=5e-4)
    constant.load_checkpoint(tmp_path / "ckpt")
    constant.train_step(batches[1])
    assert _equal(_weights(constant), after_two)

    resumed = trainer(**sched)
    assert resumed.load_checkpoint(tmp_path / "ckpt").step == 1
    for t in (resumed, from_state):
        assert t.train_step(batches[1])["lr"] == pytest.approx(5e-4)
        assert _equal(_weights(t), after_two)
