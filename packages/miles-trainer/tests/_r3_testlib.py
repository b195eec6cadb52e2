"""Shared helpers of the R3 tests: rollout weights, drifted trainer weights, and a rollout batch
recorded by a plain transformers forward (independent of miles_trainer's router patch).

Also imported by the Megatron 2-process worker, so it must not depend on pytest.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from _megatron_testlib import VOCAB

from miles_trainer import TrainBatch

TOP_K = 2
LAYERS = 2


def make_drifted(rollout_dir: Path, out: Path) -> Path:
    """The rollout weights plus 2% Gaussian noise per tensor (the trainer a few steps on)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rollout_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.std())
    model.save_pretrained(out)
    for f in rollout_dir.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def rollout(model_dir: Path, tokens: list[list[int]], lengths: list[int]) -> tuple[Any, Any]:
    """Per sample: response logprobs and routed experts ``[len - 1, layers, top_k]`` (int32
    numpy, like SGLang's) of a teacher-forced HF forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logps, routed = [], []
    with torch.no_grad():
        for toks, r in zip(tokens, lengths):
            out = model(input_ids=torch.tensor([toks]), output_router_logits=True)
            lp = torch.log_softmax(out.logits[0].float(), -1)
            n = len(toks)
            logps.append([lp[n - r - 1 + j, toks[n - r + j]].item() for j in range(r)])
            scores_NTE = torch.softmax(torch.stack(out.router_logits).float(), -1)
            top_NTK = torch.topk(scores_NTE, TOP_K, dim=-1).indices
            routed.append(top_NTK.permute(1, 0, 2)[:-1].to(torch.int32).numpy())
    return logps, routed


def samples(n: int = 8, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    tokens, lengths = [], []
    for _ in range(n):
        p, r = rng.randint(2, 6), rng.randint(4, 12)
        tokens.append([rng.randrange(VOCAB) for _ in range(p + r)])
        lengths.append(r)
    return tokens, lengths


def rollout_batch(model_dir: Path, *, with_routing: bool = True) -> TrainBatch:
    tokens, lengths = samples()
    logps, routed = rollout(model_dir, tokens, lengths)
    return TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=[[1] * r for r in lengths],
        rollout_logprobs=logps,
        rewards=[float(i % 2) for i in range(len(tokens))],
        group_ids=[i // 4 for i in range(len(tokens))],
        routed_experts=routed if with_routing else None,
    )
