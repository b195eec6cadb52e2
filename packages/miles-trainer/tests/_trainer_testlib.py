"""Shared helpers of the miles-trainer tests: a tiny Qwen3 checkpoint and random batches.

Also imported by the torchrun worker script, so it must not depend on pytest.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from miles_trainer import (
    AdvantageConfig,
    CriticConfig,
    FSDPTrainer,
    LossConfig,
    MismatchConfig,
    ReferenceConfig,
    TrainBatch,
    TrainerConfig,
)

VOCAB = 61


def make_tiny_model(path: Path, *, seed: int = 0, tie: bool = True) -> Path:
    """Save a random 2-layer Qwen3 (hidden 64) plus a real tokenizer to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        # Wider than the default 0.02 so that logits are far from uniform and ratios move.
        initializer_range=0.2,
        tie_word_embeddings=tie,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t1", pad_token="t0").save_pretrained(
        path
    )
    return path


def make_batch(
    n: int,
    *,
    seed: int = 0,
    max_prompt: int = 6,
    max_response: int = 9,
    rollout_logprob: float = -3.0,
) -> TrainBatch:
    """Random samples of varied lengths, masks with some zeros, +/-1 and fractional advantages."""
    rng = random.Random(seed)
    tokens, lengths, masks, rollout, adv = [], [], [], [], []
    for _ in range(n):
        p, r = rng.randint(1, max_prompt), rng.randint(1, max_response)
        tokens.append([rng.randrange(VOCAB) for _ in range(p + r)])
        lengths.append(r)
        mask = [1] * r
        if r > 2:
            mask[rng.randrange(1, r)] = 0  # a tool token in the middle
        masks.append(mask)
        rollout.append([rollout_logprob + rng.uniform(-0.5, 0.5) for _ in range(r)])
        a = rng.choice([-1.0, 1.0, 0.5])
        adv.append([a] * r)
    return TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=masks,
        rollout_logprobs=rollout,
        advantages=adv,
    )


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of a sharded model's parameters. Collective."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.clone().cpu()
    return out


def scenario_config(model_dir: str, dtype: str = "float32") -> TrainerConfig:
    """The config of the 1-vs-2-process comparison: every loss term on, uneven shares."""
    return TrainerConfig(
        model_path=model_dir,
        dtype=dtype,
        lr=1e-3,
        eps=1e-6,  # see test_trainer_fsdp.EPS
        micro_batch_size=1,
        num_minibatches=2,
        loss=LossConfig(
            loss_agg="seq-mean-token-mean",
            kl_coef=0.05,
            entropy_coef=0.01,
            mismatch=MismatchConfig(upper=2.0),
        ),
    )


def run_scenario(trainer: FSDPTrainer) -> list[dict[str, float]]:
    """Two train steps on 5-sample batches (ranks get 3 and 2 samples: a filler pass)."""
    return [trainer.train_step(make_batch(5, seed=s)) for s in (11, 12)]


def multiturn_config(model_dir: str) -> TrainerConfig:
    """The multi-turn 1-vs-2-process comparison: packed micro-batches by token budget (ranks
    get different numbers of them: filler passes), PPO with a critic (values gathered across
    ranks for GAE), geometric MIS, KL to a reference kept as a full copy on the CPU."""
    return TrainerConfig(
        model_path=model_dir,
        lr=1e-3,
        eps=1e-6,
        packing=True,
        max_tokens_per_microbatch=24,
        num_minibatches=2,
        advantage=AdvantageConfig(estimator="gae", lam=0.9, whiten=True),
        critic=CriticConfig(lr=1e-3),
        reference=ReferenceConfig(placement="cpu"),
        loss=LossConfig(kl_coef=0.05, mismatch=MismatchConfig(level="geometric", upper=2.0)),
    )


def run_multiturn_scenario(trainer: FSDPTrainer) -> list[dict[str, float]]:
    """Two train steps on 7-sample multi-turn batches."""
    return [trainer.train_step(multiturn_batch(7, seed=s)) for s in (21, 22)]


def multiturn_batch(n: int, *, seed: int = 0, group_size: int = 2) -> TrainBatch:
    """Agentic samples: turns of generated tokens with tool outputs (mask 0) between them, the
    turns produced by different weight versions, rewards per sample, groups of prompts."""
    rng = random.Random(seed)
    tokens, lengths, masks, rollout, versions, rewards = [], [], [], [], [], []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        response: list[int] = []
        mask: list[int] = []
        ver: list[str | None] = []
        for turn in range(rng.randint(1, 3)):
            if turn:  # a tool output between turns: not trained on
                k = rng.randint(1, 4)
                response += [rng.randrange(VOCAB) for _ in range(k)]
                mask += [0] * k
                ver += [None] * k
            k = rng.randint(1, 5)
            response += [rng.randrange(VOCAB) for _ in range(k)]
            mask += [1] * k
            ver += [str(3 + turn)] * k
        tokens.append(prompt + response)
        lengths.append(len(response))
        masks.append(mask)
        rollout.append([-3.0 + rng.uniform(-0.5, 0.5) for _ in response])
        versions.append(ver)
        rewards.append(float(rng.randint(0, 1)))
    return TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=masks,
        rollout_logprobs=rollout,
        rewards=rewards,
        group_ids=[i // group_size for i in range(n)],
        weight_versions=versions,
    )
