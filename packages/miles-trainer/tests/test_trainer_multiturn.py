"""Multi-turn samples in the trainer: loss masks with holes, per-token weight versions,
sequence packing, micro-batches by token budget, advantages computed by the trainer, and bad
input (disagreeing samples, non-finite losses)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_testlib import full_params, multiturn_batch

from miles_trainer import (
    AdvantageConfig,
    FSDPTrainer,
    LossConfig,
    MismatchConfig,
    NonFiniteError,
    TrainBatch,
    TrainerConfig,
    grpo_advantages,
)
from miles_trainer.batch import plan_micro_batches

# Packed vs padded (fp32, one thread): gradients differ only in the order of fp32 sums.
# Measured max |grad diff| 6e-9 .. 1.4e-8 over the three layouts; metrics rel < 1e-6.
GRAD_ATOL = 1e-6
METRIC_RTOL = 1e-6


def _cfg(model_dir: Path, **kw: Any) -> TrainerConfig:
    base: dict[str, Any] = {"model_path": str(model_dir), "lr": 1e-3, "eps": 1e-6}
    base.update(kw)
    return TrainerConfig(**base)


def _step_capturing_grads(
    trainer: FSDPTrainer, batch: TrainBatch
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One train_step; the gradients the optimizer was handed (read at its step)."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer._optimizer.step
    names = {id(p): n for n, p in trainer.model.named_parameters()}

    def capture(*args: Any, **kwargs: Any) -> Any:
        for group in trainer._optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = p.grad.detach().clone()
        return step(*args, **kwargs)

    trainer._optimizer.step = capture  # type: ignore[method-assign]
    return trainer.train_step(batch), grads


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


LOSS = LossConfig(
    loss_agg="seq-mean-token-mean",
    kl_coef=0.05,
    entropy_coef=0.01,
    mismatch=MismatchConfig(level="geometric", upper=2.0),
)


@pytest.mark.parametrize(
    "layout",
    [
        {"packing": True, "micro_batch_size": 8},
        {"packing": True, "max_tokens_per_microbatch": 40},  # several packed micro-batches
        {"packing": False, "max_tokens_per_microbatch": 40},
    ],
)
def test_packed_and_budgeted_match_padded(tiny_model_dir: Path, layout: dict[str, Any]) -> None:
    """The same loss and gradients as one padded micro-batch, within fp32 rounding."""
    batch = multiturn_batch(8, seed=1)
    want_m, want_g = _step_capturing_grads(
        FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=8, loss=LOSS)), batch
    )
    got_m, got_g = _step_capturing_grads(
        FSDPTrainer(_cfg(tiny_model_dir, loss=LOSS, **layout)), batch
    )
    diff = _max_diff(got_g, want_g)
    print(f"max |grad diff| {layout} vs padded: {diff:.3g}")
    assert diff < GRAD_ATOL
    assert max(v.abs().max().item() for v in want_g.values()) > 1e3 * GRAD_ATOL
    for key in ("loss", "pg_loss", "kl", "entropy", "is_weight_mean", "grad_norm"):
        assert got_m[key] == pytest.approx(want_m[key], rel=METRIC_RTOL, abs=1e-9), key


def test_packed_logprobs_match_padded(tiny_model_dir: Path) -> None:
    batch = multiturn_batch(6, seed=2)
    padded = FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=6))
    packed = FSDPTrainer(_cfg(tiny_model_dir, packing=True, max_tokens_per_microbatch=30))
    a = padded.compute_logprobs(batch.tokens, batch.response_lengths)
    b = packed.compute_logprobs(batch.tokens, batch.response_lengths)
    assert max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)) < 1e-5


def test_bfloat16_packing_keeps_samples_apart(tiny_model_dir: Path) -> None:
    """bf16 on CPU runs the trainer's own attention (`_attention.py`); packed, it must get the
    block-diagonal mask. Measured: bit-identical to padded here; without the mask (attending
    across samples) the logprobs were off by up to 6.2."""
    batch = multiturn_batch(6, seed=2)
    got = {}
    for packing in (False, True):
        trainer = FSDPTrainer(_cfg(tiny_model_dir, dtype="bfloat16", packing=packing))
        got[packing] = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    diff = max(abs(x - y) for xs, ys in zip(got[False], got[True]) for x, y in zip(xs, ys))
    assert diff < 0.05  # bf16 rounding could differ with the GEMM shapes on another CPU


def test_token_budget_plans() -> None:
    lengths = [5, 3, 8, 2, 20, 4]
    # packed: sum of lengths within 10 (5+3, 8+2); the 20-token sample goes alone
    packed = plan_micro_batches(lengths, range(6), micro_batch_size=99, max_tokens=10, packed=True)
    assert packed == [[0, 1], [2, 3], [4], [5]]
    # padded: count x longest within 10: [5, 3] -> 2 x 5; [8] ; [2, ...] 2 x 20 no
    assert plan_micro_batches(lengths, [0, 1, 3, 5], micro_batch_size=99, max_tokens=10) == [
        [0, 1],
        [3, 5],
    ]
    assert plan_micro_batches(lengths, range(5), micro_batch_size=2) == [[0, 1], [2, 3], [4]]


def test_masked_tokens_contribute_no_gradient(tiny_model_dir: Path) -> None:
    """Whatever the rollout logprobs and advantages of the tool tokens (mask 0), the update
    is bit for bit the same: they reach no loss term (KL, entropy and the sequence-level
    mismatch weights included) and no gradient."""
    batch = multiturn_batch(6, seed=3)
    adv = grpo_advantages(batch.rewards or [], group_ids=batch.group_ids)
    clean = dataclasses.replace(
        batch,
        rewards=None,
        advantages=[[a] * r for a, r in zip(adv, batch.response_lengths)],
    )
    noisy = dataclasses.replace(
        clean,
        rollout_logprobs=[
            [lp if m else 5.0 + 100.0 * t for t, (lp, m) in enumerate(zip(row, mask))]
            for row, mask in zip(clean.rollout_logprobs, clean.loss_masks)
        ],
        advantages=[
            [a if m else -1e6 for a, m in zip(row, mask)]
            for row, mask in zip(clean.advantages or [], clean.loss_masks)
        ],
    )
    assert sum(m == 0 for mask in batch.loss_masks for m in mask) >= 3  # there are holes
    results = []
    for b in (clean, noisy):
        trainer = FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=3, loss=LOSS))
        metrics, grads = _step_capturing_grads(trainer, b)
        results.append((metrics, grads, full_params(trainer.model)))
    (m1, g1, p1), (m2, g2, p2) = results
    assert _max_diff(g1, g2) == 0.0
    assert _max_diff(p1, p2) == 0.0
    assert m1 == m2


def test_trainer_computes_advantages_from_rewards(tiny_model_dir: Path) -> None:
    """rewards + group_ids with the default estimator (GRPO) == precomputed GRPO advantages."""
    batch = multiturn_batch(6, seed=4, group_size=3)
    adv = grpo_advantages(batch.rewards or [], group_ids=batch.group_ids)
    pre = dataclasses.replace(
        batch, rewards=None, advantages=[[a] * r for a, r in zip(adv, batch.response_lengths)]
    )
    a = FSDPTrainer(_cfg(tiny_model_dir))
    ma = a.train_step(batch)
    b = FSDPTrainer(_cfg(tiny_model_dir))
    mb = b.train_step(pre)
    assert _max_diff(full_params(a.model), full_params(b.model)) == 0.0
    assert ma["loss"] == mb["loss"]
    assert ma["reward_mean"] == pytest.approx(sum(batch.rewards or []) / 6)
    assert "reward_mean" not in mb  # precomputed advantages: no reward statistics


def test_group_filter_trains_on_the_kept_groups_only(tiny_model_dir: Path) -> None:
    batch = multiturn_batch(8, seed=5)
    assert batch.rewards is not None
    batch.rewards[:4] = [1.0, 1.0, 0.0, 0.0]  # group 0 constant, group 1 varies
    cfg = _cfg(tiny_model_dir, advantage=AdvantageConfig(group_filter="nonzero_std"))
    filtered = FSDPTrainer(cfg)
    metrics = filtered.train_step(batch)
    gids = batch.group_ids or []
    rewards_of = {g: {r for r, h in zip(batch.rewards, gids) if h == g} for g in gids}
    kept = [i for i in range(8) if len(rewards_of[gids[i]]) > 1]
    assert 0 < len(kept) < 8
    manual = FSDPTrainer(_cfg(tiny_model_dir))
    manual.train_step(batch.select(kept))
    assert metrics["groups_filtered"] >= 1
    assert metrics["samples"] == len(kept)
    assert _max_diff(full_params(filtered.model), full_params(manual.model)) == 0.0


def test_weight_version_metrics(tiny_model_dir: Path) -> None:
    batch = multiturn_batch(4, seed=6)
    metrics = FSDPTrainer(_cfg(tiny_model_dir)).train_step(batch)
    versions = {
        int(v)
        for row, mask in zip(batch.weight_versions or [], batch.loss_masks)
        for v, m in zip(row, mask)
        if m and v is not None
    }
    assert metrics["weight_versions"] == len(versions)
    assert metrics["weight_version_lag_max"] == max(versions) - min(versions)
    assert 0.0 < metrics["stale_token_frac"] < 1.0


@dataclasses.dataclass
class _Sample:
    """The fields `TrainBatch.from_samples` reads (as miles_rollout.Sample has them)."""

    group_index: int
    index: int
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float | None
    weight_versions: list[str | None] = dataclasses.field(default_factory=list)


def test_from_samples_and_errors_that_name_the_sample() -> None:
    good = _Sample(0, 0, [1, 2, 3, 4], 3, [1, 0, 1], [-0.5, 0.0, -1.0], 1.0, ["7", None, "8"])
    other = _Sample(0, 1, [1, 2, 3], 2, [1, 1], [-0.1, -0.2], 0.0)
    batch = TrainBatch.from_samples([good, other])
    assert batch.group_ids == [0, 0]
    assert batch.rewards == [1.0, 0.0]
    assert batch.weight_versions == [["7", None, "8"], [None, None]]
    with pytest.raises(ValueError, match=r"sample \(group 0, index 1\) has no reward"):
        TrainBatch.from_samples([good, dataclasses.replace(other, reward=None)])
    with pytest.raises(ValueError, match=r"sample 1 \(group 0, index 1\): len\(loss_masks\[1\]\)"):
        TrainBatch.from_samples([good, dataclasses.replace(other, loss_mask=[1])])
    bad_lp = dataclasses.replace(other, rollout_logprobs=[-0.1, 0.7])
    with pytest.raises(
        ValueError, match=r"sample 1 \(group 0, index 1\): rollout_logprobs\[1\]\[1\]"
    ):
        TrainBatch.from_samples([good, bad_lp])
    with pytest.raises(ValueError, match=r"weight_versions has 2 entries; it needs one per"):
        TrainBatch.from_samples([dataclasses.replace(good, weight_versions=["7", None])])
    with pytest.raises(ValueError, match=r"needs rewards .* or advantages"):
        TrainBatch(
            tokens=[[1, 2]], response_lengths=[1], loss_masks=[[1]], rollout_logprobs=[[-1.0]]
        )
    with pytest.raises(ValueError, match=r"sample 0: reward nan is not finite"):
        TrainBatch(
            tokens=[[1, 2]],
            response_lengths=[1],
            loss_masks=[[1]],
            rollout_logprobs=[[-1.0]],
            rewards=[float("nan")],
        )


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_loss_leaves_the_weights_untouched(tiny_model_dir: Path, policy: str) -> None:
    batch = multiturn_batch(4, seed=7)
    cfg = _cfg(tiny_model_dir, on_nonfinite=policy, loss=LossConfig(name="_trainer_hooks:nan_loss"))
    trainer = FSDPTrainer(cfg)
    before = full_params(trainer.model)
    if policy == "stop":
        with pytest.raises(NonFiniteError, match=r"mini-batch 0.*weights are untouched"):
            trainer.train_step(batch)
    else:
        metrics = trainer.train_step(batch)
        assert metrics["skipped_steps"] == 1.0
        assert metrics["optimizer_steps"] == 0.0
    assert _max_diff(full_params(trainer.model), before) == 0.0
    assert not trainer._optimizer.state  # AdamW never stepped: no moments either
    # and the trainer still trains afterwards once the loss is sane
    trainer._loss_fn = LossConfig().build()
    trainer.train_step(batch)
    assert _max_diff(full_params(trainer.model), before) > 0.0
