"""FSDPTrainer on one process (gloo, world size 1) with a real tiny Qwen3."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _trainer_testlib import VOCAB, full_params, make_batch
from safetensors import safe_open

from miles_trainer import FSDPTrainer, LossConfig, TrainBatch, TrainerConfig
from miles_trainer._hf_dir import write_hf_dir

# Measured: max |diff| 2.9e-6 over 3 temperatures x 3 batches (see README).
LOGPROB_ATOL = 1e-5


# Adam's first step is lr * g / (|g| + eps): a gradient near eps in size turns an fp32
# reduction-order difference into a visible weight difference (up to lr / (4 eps) times it).
# eps = 1e-6 keeps that amplification small enough to compare updates; see the README.
EPS = 1e-6
# Measured over 4 seeds: max |param diff| 4.2e-6 after one lr=1e-3 step (see README).
UPDATE_ATOL = 2e-5


def _cfg(model_dir: Path, **kw: object) -> TrainerConfig:
    base: dict[str, object] = {
        "model_path": str(model_dir),
        "lr": 1e-3,
        "eps": EPS,
        "micro_batch_size": 4,
    }
    base.update(kw)
    return TrainerConfig(**base)  # type: ignore[arg-type]


def _hf_logprobs(model_dir: Path, batch: TrainBatch, temperature: float) -> list[list[float]]:
    """A plain HF forward per sample: log_softmax(logits / T) gathered at the response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for toks, r in zip(batch.tokens, batch.response_lengths):
            ids = torch.tensor([toks])
            logits = model(input_ids=ids).logits[0].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            pos = range(len(toks) - r - 1, len(toks) - 1)
            out.append([logp[p, toks[p + 1]].item() for p in pos])
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_logprobs_match_plain_hf_forward(tiny_model_dir: Path) -> None:
    batch = make_batch(7, seed=1)
    trainer = FSDPTrainer(_cfg(tiny_model_dir, temperature=0.7, micro_batch_size=3))
    got = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    want = _hf_logprobs(tiny_model_dir, batch, 0.7)
    assert [len(x) for x in got] == batch.response_lengths
    diff = max(abs(g - w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    assert diff < LOGPROB_ATOL


def test_bfloat16_compute_keeps_float32_master_weights(tiny_model_dir: Path) -> None:
    batch = make_batch(5, seed=10)
    fp32 = FSDPTrainer(_cfg(tiny_model_dir)).compute_logprobs(batch.tokens, batch.response_lengths)
    trainer = FSDPTrainer(_cfg(tiny_model_dir, dtype="bfloat16"))
    bf16 = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    diff = max(abs(a - b) for xs, ys in zip(fp32, bf16) for a, b in zip(xs, ys))
    assert 0 < diff < 0.2  # bf16 matmuls: close, but not the fp32 numbers
    before = full_params(trainer.model)
    trainer.train_step(batch)
    after = full_params(trainer.model)
    assert all(t.dtype == torch.float32 for t in after.values())
    assert _max_diff(before, after) > 1e-4


def test_on_policy_step_starts_at_ratio_one_and_zero_mismatch(tiny_model_dir: Path) -> None:
    """Rollout logprobs from the same weights: ratio 1, mismatch ~0, KL to ref 0."""
    batch = make_batch(6, seed=2)
    batch.rollout_logprobs = _hf_logprobs(tiny_model_dir, batch, 1.0)
    cfg = _cfg(tiny_model_dir, loss=LossConfig(kl_coef=0.1))
    metrics = FSDPTrainer(cfg).train_step(batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_frac"] == 0.0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["train_rollout_logprob_abs_diff"] < LOGPROB_ATOL
    assert metrics["tokens"] == batch.num_loss_tokens()
    assert metrics["grad_norm"] > 0
    assert metrics["lr"] == 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_minibatch_reuses_the_training_forward_as_old_logprobs(
    tiny_model_dir: Path, dtype: str
) -> None:
    """num_minibatches == 1 skips the no-grad pass: same update as a separate pass."""
    batch = make_batch(6, seed=13)
    terms = {"loss_agg": "seq-mean-token-mean", "kl_coef": 0.05, "entropy_coef": 0.01}
    fast = FSDPTrainer(_cfg(tiny_model_dir, dtype=dtype, loss=LossConfig(**terms)))
    got = fast.train_step(batch)
    # The general path by hand: old logprobs from a no-grad pass, handed in as the rollout's.
    cfg = _cfg(tiny_model_dir, dtype=dtype, loss=LossConfig(use_rollout_logprobs=True, **terms))
    slow = FSDPTrainer(cfg)
    old = slow.compute_logprobs(batch.tokens, batch.response_lengths)
    want = slow.train_step(dataclasses.replace(batch, rollout_logprobs=old))
    assert _max_diff(full_params(fast.model), full_params(slow.model)) == 0.0
    assert got["ratio_mean"] == pytest.approx(1.0, abs=1e-7)  # a float32 token mean of ones
    assert got["clip_frac"] == 0.0
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert got[key] == want[key], key
    # The mismatch metric still compares the pre-update policy with the rollout.
    batch_diff = [
        abs(a - b) * m
        for xs, ys, ms in zip(old, batch.rollout_logprobs, batch.loss_masks)
        for a, b, m in zip(xs, ys, ms)
    ]
    assert got["train_rollout_logprob_abs_diff"] == pytest.approx(
        sum(batch_diff) / batch.num_loss_tokens(), rel=1e-6
    )


def test_one_rank_trains_a_plain_module(tiny_model_dir: Path) -> None:
    """World size 1: no FSDP2 wrapping, no DTensors (their overhead buys nothing there)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    trainer = FSDPTrainer(_cfg(tiny_model_dir, dtype="bfloat16"))
    assert not isinstance(trainer.model, FSDPModule)
    params = dict(trainer.model.named_parameters())
    assert not any(isinstance(p, DTensor) for p in params.values())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert "model.embed_tokens.weight" in params


def test_step_lowers_loss_on_repeated_batch(tiny_model_dir: Path) -> None:
    batch = make_batch(6, seed=3)
    trainer = FSDPTrainer(_cfg(tiny_model_dir, loss=LossConfig(use_rollout_logprobs=False)))
    before = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    trainer.train_step(batch)
    after = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    # Positive-advantage tokens must become more likely on average, negative less likely.
    moved = 0.0
    for i in range(len(batch)):
        for t in range(batch.response_lengths[i]):
            if batch.loss_masks[i][t]:
                moved += batch.advantages[i][t] * (after[i][t] - before[i][t])
    assert moved > 0


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_padding_does_not_change_the_update(tiny_model_dir: Path, loss_agg: str) -> None:
    """micro_batch_size 1 (no padding) vs 8 (one right-padded micro-batch)."""
    batch = make_batch(6, seed=4)
    loss = LossConfig(loss_agg=loss_agg, kl_coef=0.05, entropy_coef=0.01)
    results = []
    for mbs in (1, 8):
        trainer = FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=mbs, loss=loss))
        metrics = trainer.train_step(batch)
        results.append((metrics, full_params(trainer.model)))
    (m1, p1), (m8, p8) = results
    assert _max_diff(p1, p8) < UPDATE_ATOL
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert m1[key] == pytest.approx(m8[key], rel=1e-6, abs=1e-7), key


def test_two_minibatches_equal_two_manual_steps(tiny_model_dir: Path) -> None:
    batch = make_batch(6, seed=5)
    loss = LossConfig(use_rollout_logprobs=True)  # old logprobs must not depend on the split
    one = FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=2, num_minibatches=2, loss=loss))
    one.train_step(batch)
    two = FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=2, loss=loss))
    for part in (slice(0, 3), slice(3, 6)):
        two.train_step(
            TrainBatch(
                tokens=batch.tokens[part],
                response_lengths=batch.response_lengths[part],
                loss_masks=batch.loss_masks[part],
                rollout_logprobs=batch.rollout_logprobs[part],
                advantages=batch.advantages[part],
            )
        )
    assert _max_diff(full_params(one.model), full_params(two.model)) == 0.0
    # And the split matters: one big step lands elsewhere.
    big = FSDPTrainer(_cfg(tiny_model_dir, micro_batch_size=2, loss=loss))
    big.train_step(batch)
    assert _max_diff(full_params(one.model), full_params(big.model)) > 1e-5


def test_bad_batches_raise_clear_errors(tiny_model_dir: Path) -> None:
    trainer = FSDPTrainer(_cfg(tiny_model_dir, num_minibatches=4))
    with pytest.raises(ValueError, match="num_minibatches = 4"):
        trainer.train_step(make_batch(3))
    batch = make_batch(5)
    batch.tokens[2][0] = VOCAB + 3
    with pytest.raises(ValueError, match=f"sample 2: token id {VOCAB + 3} is out of range"):
        trainer.train_step(batch)


def test_missing_model_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        FSDPTrainer(_cfg(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        FSDPTrainer(_cfg(tmp_path))


def test_save_hf_checkpoint_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = FSDPTrainer(_cfg(tiny_model_dir))
    trainer.train_step(make_batch(4, seed=6))
    out = tmp_path / "ckpt"
    trainer.save_hf_checkpoint(out)
    want = full_params(trainer.model)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = {k: v.detach() for k, v in loaded.named_parameters()}
    assert _max_diff(got, want) == 0.0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names  # tied: written once, as save_pretrained does
    assert "model.embed_tokens.weight" in names
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("t5") == 5
    assert (out / "generation_config.json").is_file()

    # Saving again replaces it (new weights), leaving no temp or old dirs behind.
    trainer.train_step(make_batch(4, seed=7))
    trainer.save_hf_checkpoint(out, dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.norm.weight")
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, full_params(trainer.model)["model.norm.weight"].to(torch.bfloat16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failed_write_leaves_the_old_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "marker").write_text("old")
    t = torch.ones(3)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    # safetensors refuses tensors that share memory: a real failure in the middle of the write.
    with pytest.raises(RuntimeError, match="share memory"):
        write_hf_dir(
            out,
            {"a": t, "b": t},
            config=config,
            generation_config=None,
            source_dir=str(tiny_model_dir),
            dtype=torch.float32,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in out.iterdir()) == ["marker"]


def test_resume_from_state_dict(tiny_model_dir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    b1, b2 = make_batch(4, seed=8), make_batch(4, seed=9)
    a = FSDPTrainer(_cfg(tiny_model_dir))
    a.train_step(b1)
    state = a.state_dict()
    b = FSDPTrainer(_cfg(tiny_model_dir))
    b.load_state_dict(state)
    weights_only = FSDPTrainer(_cfg(tiny_model_dir))  # same weights, fresh Adam moments
    set_model_state_dict(weights_only.model, state["model"])
    for trainer in (a, b, weights_only):
        trainer.train_step(b2)
    assert _max_diff(full_params(a.model), full_params(b.model)) == 0.0
    assert _max_diff(full_params(a.model), full_params(weights_only.model)) > 1e-6
