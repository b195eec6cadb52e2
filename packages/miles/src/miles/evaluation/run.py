"""Evaluate a policy on held-out prompts through any engine client: greedy and sampled accuracy."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from miles_rollout import EngineClient, PromptItem, RewardFn, SamplingParams, generate_rollout

__all__ = ["evaluate", "heldout_prompts"]


def heldout_prompts(task: Any, n: int) -> list[PromptItem]:
    """``n`` prompts the run never trains on.

    A task that can guarantee it implements ``heldout(n)`` (the arithmetic task keeps a
    partition of its prompt space out of ``sample``); for another task, fixed prompts are
    drawn once from ``sample`` at the start, before training takes any, and may recur in
    training: the metrics then measure fit, not generalisation.
    """
    heldout = getattr(task, "heldout", None)
    if callable(heldout):
        return list(heldout(n))
    return list(task.sample(n))


async def evaluate(
    client: EngineClient,
    tokenizer: Any,
    items: Sequence[PromptItem],
    *,
    sampling_params: SamplingParams,
    reward_fn: RewardFn,
    sampled_n: int,
    max_concurrency: int = 256,
    reward_errors: str = "drop",
) -> dict[str, float]:
    """Accuracy (mean reward) of greedy decoding and of ``sampled_n`` samples per prompt.

    ``reward_errors`` is the run's ``task.reward_errors`` (see ``miles_rollout.reward``): a
    sample whose reward failed counts as 0 unless it is ``"fail"``, which raises.

    Returns:
        ``accuracy_greedy``, ``accuracy_sampled``, ``response_len_greedy``, ``seconds`` and
        ``failed`` (samples the engine or the reward could not finish; they count as 0).
    """
    t0 = time.perf_counter()
    greedy = dataclasses.replace(sampling_params, temperature=0.0, seed=None)
    out: dict[str, float] = {}
    for name, params, n in (("greedy", greedy, 1), ("sampled", sampling_params, sampled_n)):
        if n == 0:
            continue
        result = await generate_rollout(
            client,
            tokenizer,
            items,
            n_samples_per_prompt=n,
            sampling_params=params,
            reward_fn=reward_fn,
            max_concurrency=max_concurrency,
            reward_errors=reward_errors,
        )
        samples = result.samples
        rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
        out[f"accuracy_{name}"] = sum(rewards) / len(rewards)
        out[f"response_len_{name}"] = sum(s.response_length for s in samples) / len(samples)
        out["failed"] = out.get("failed", 0.0) + sum(s.reward is None for s in samples)
    out["seconds"] = time.perf_counter() - t0
    return out
