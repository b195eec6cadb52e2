"""The Megatron backend's config, its refusals, resume and non-finite steps (one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _megatron_testlib import save_tiny, tiny_qwen3_config
from _trainer_testlib import make_batch

from miles_trainer import (
    AdvantageConfig,
    CriticConfig,
    LossConfig,
    NonFiniteError,
    QATConfig,
    TrainerConfig,
)
from miles_trainer.megatron import MegatronConfig
from miles_trainer.megatron.trainer import MegatronTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_qwen3_config(), tmp_path_factory.mktemp("mg-trainer") / "model")


def _trainer(model_dir: Path, **kw: object) -> MegatronTrainer:
    cfg = TrainerConfig(
        model_path=str(model_dir), backend="megatron", lr=1e-3, micro_batch_size=2, **kw
    )
    trainer = cfg.build()
    assert isinstance(trainer, MegatronTrainer)
    return trainer


def _weights(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_hf_tensors()}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tp": 0}, "tp must be an integer >= 1"),
        ({"sequence_parallel": True}, "sequence_parallel needs tp > 1"),
        ({"tp": 2, "ep": 2}, "needs sequence_parallel: true"),
        ({"transformer_impl": "te"}, "transformer_impl must be one of"),
        ({"moe_token_dispatcher": "flex"}, "moe_token_dispatcher must be"),
    ],
)
def test_config_is_validated(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MegatronConfig(**kw)  # type: ignore[arg-type]


def test_layout_must_fit_the_world() -> None:
    with pytest.raises(ValueError, match=r"1 ranks cannot hold MegatronConfig tp=2 x pp=1"):
        MegatronConfig(tp=2).data_parallel_size(1)
    with pytest.raises(ValueError, match=r"etp=1 x ep=4 must divide dp x tp = 2 x 1"):
        MegatronConfig(ep=4).data_parallel_size(2)
    assert MegatronConfig(tp=2, pp=2).data_parallel_size(8) == 2


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"qat": QATConfig()}, r"trainer.qat \(INT4 QAT\) is not supported"),
        (
            {"critic": CriticConfig(), "advantage": AdvantageConfig(estimator="gae")},
            r"trainer.critic .* is not supported",
        ),
    ],
)
def test_unsupported_options_are_refused(model_dir: Path, kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _trainer(model_dir, **kw)


def test_resume_from_state_dict_is_bit_exact(model_dir: Path) -> None:
    """state_dict after step 1, step 2, step 3, load, step 2 again: the same weights as the
    first step 2, bit for bit (the distributed optimizer's moments and step travel along)."""
    trainer = _trainer(model_dir)
    trainer.train_step(make_batch(5, seed=1))
    state = trainer.state_dict()
    trainer.train_step(make_batch(5, seed=2))
    after_two = _weights(trainer)
    trainer.train_step(make_batch(5, seed=3))
    trainer.load_state_dict(state)
    trainer.train_step(make_batch(5, seed=2))
    again = _weights(trainer)
    for name, t in after_two.items():
        assert torch.equal(again[name], t), name
    with pytest.raises(ValueError, match="cannot load into"):
        trainer.load_state_dict(dict(state, layout=None))


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_loss_leaves_the_weights_untouched(model_dir: Path, policy: str) -> None:
    trainer = _trainer(
        model_dir, on_nonfinite=policy, loss=LossConfig(name="_trainer_hooks:nan_loss")
    )
    before = _weights(trainer)
    batch = make_batch(5, seed=4)
    if policy == "stop":
        with pytest.raises(NonFiniteError, match=r"mini-batch 0.*weights are untouched"):
            trainer.train_step(batch)
    else:
        metrics = trainer.train_step(batch)
        assert metrics["skipped_steps"] == 1.0
        assert metrics["optimizer_steps"] == 0.0
    after = _weights(trainer)
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_only_the_cuda_scheduling_hint_is_silenced_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's real TP linear (allreduce_dgrad: what TP 2 runs) asks for
    CUDA_DEVICE_MAX_CONNECTIONS=1 once per process; the CPU filter drops exactly that."""
    import warnings

    from megatron.core.tensor_parallel import layers

    from miles_trainer.megatron import cpu_compat

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    fn = layers.linear_with_grad_accumulation_and_async_allreduce
    monkeypatch.setattr(fn, "warned", False)
    x, w = torch.randn(3, 4), torch.randn(5, 4)

    def call(**kw: object) -> list[str]:
        fn.warned = False
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if kw.pop("quiet", False):
                cpu_compat.quiet_cuda_only_hints()
            # tp_group is only kept for the backward pass: the forward here communicates nothing
            out = fn(x, w, None, False, True, False, tp_group=object(), **kw)
        assert torch.equal(out, x @ w.T)
        return [f"{r.category.__name__}: {r.message}" for r in seen]

    assert any("CUDA_DEVICE_MAX_CONNECTIONS" in m for m in call())  # megatron warns without it
    assert call(quiet=True) == []
    # Another warning from the same function still shows.
    shown = call(quiet=True, async_grad_allreduce=True)
    assert len(shown) == 1, shown
    assert shown[0].startswith("UserWarning: async_grad_allreduce is deprecated")
