"""Rollout orchestration: turn prompts into graded groups of samples through any engine client.

The same code drives the embedded engine (``LocalEngineClient``) and SGLang servers
(``SGLangClient``): it only calls ``client.generate``. Every sample of a group is submitted at
once, so the engine's continuous batching sees the whole rollout batch; a semaphore bounds
in-flight requests.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_rollout.sample import Sample, SampleStatus
from miles_rollout.tasks.arithmetic import PromptItem

if TYPE_CHECKING:
    from miles_rollout.client import EngineClient
    from miles_rollout.sampling_params import SamplingParams

__all__ = ["RewardFn", "RolloutResult", "encode_prompt", "generate_rollout", "rollout_metrics"]

RewardFn = Callable[[Sample], "float | Awaitable[float]"]


@dataclass(kw_only=True, slots=True)
class RolloutResult:
    """Graded groups of one rollout step plus how long it took."""

    groups: list[list[Sample]]
    seconds: float

    @property
    def samples(self) -> list[Sample]:
        """All samples, group by group."""
        return [s for g in self.groups for s in g]


def encode_prompt(tokenizer: Any, prompt: list[dict[str, str]] | str) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template, raw text as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False).input_ids)
    return list(
        tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


async def _grade(sample: Sample, reward_fn: RewardFn) -> None:
    value = reward_fn(sample)
    if inspect.isawaitable(value):
        value = await value
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward!r} for sample {sample.group_index}")
    sample.reward = reward


async def _run_one(
    client: EngineClient,
    tokenizer: Any,
    sample: Sample,
    prompt_ids: list[int],
    sampling_params: SamplingParams,
    reward_fn: RewardFn,
    semaphore: asyncio.Semaphore,
) -> Sample:
    async with semaphore:
        out = await client.generate(prompt_ids, sampling_params, return_logprob=True)
    ids = list(out.output_ids)
    logprobs = list(out.output_logprobs or [])
    if len(logprobs) != len(ids):
        raise RuntimeError(
            f"engine returned {len(ids)} tokens but {len(logprobs)} logprobs; the rollout needs "
            "one logprob per generated token (return_logprob=True)"
        )
    sample.tokens = prompt_ids + ids
    sample.response_length = len(ids)
    sample.loss_mask = [1] * len(ids)
    sample.rollout_logprobs = logprobs
    sample.response = tokenizer.decode(ids, skip_special_tokens=True)
    sample.weight_version = out.weight_version
    kind = out.finish_reason.type
    sample.metadata["finish_reason"] = kind
    sample.status = {
        "stop": SampleStatus.COMPLETED,
        "length": SampleStatus.TRUNCATED,
        "abort": SampleStatus.ABORTED,
    }.get(kind, SampleStatus.FAILED)
    if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
        await _grade(sample, reward_fn)
    return sample


async def generate_rollout(
    client: EngineClient,
    tokenizer: Any,
    items: Sequence[PromptItem],
    *,
    n_samples_per_prompt: int,
    sampling_params: SamplingParams,
    reward_fn: RewardFn,
    max_concurrency: int = 256,
) -> RolloutResult:
    """Generate and grade ``n_samples_per_prompt`` samples for each prompt.

    Args:
        client: any engine client (embedded or SGLang over HTTP).
        tokenizer: the policy's HF tokenizer (chat template and decoding).
        items: prompts with their labels.
        n_samples_per_prompt: group size (GRPO's G).
        sampling_params: engine sampling parameters shared by every request.
        reward_fn: ``reward_fn(sample) -> float`` (sync or async); called once per finished sample.
        max_concurrency: bound on requests in flight.

    Returns:
        The groups, in prompt order, each with ``n_samples_per_prompt`` samples.
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    t0 = time.perf_counter()
    semaphore = asyncio.Semaphore(max_concurrency)
    groups: list[list[Sample]] = []
    tasks = []
    for gi, item in enumerate(items):
        prompt_ids = encode_prompt(tokenizer, item.messages)
        group = [
            Sample(group_index=gi, index=i, prompt=item.messages, label=item.label)
            for i in range(n_samples_per_prompt)
        ]
        groups.append(group)
        tasks += [
            _run_one(client, tokenizer, s, prompt_ids, sampling_params, reward_fn, semaphore)
            for s in group
        ]
    await asyncio.gather(*tasks)
    return RolloutResult(groups=groups, seconds=time.perf_counter() - t0)


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Summary numbers of one rollout step (reward over graded samples only)."""
    graded = [s.reward for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    n = max(1, len(samples))
    return {
        "reward_mean": sum(graded) / len(graded) if graded else float("nan"),
        "response_len_mean": sum(lengths) / n,
        "truncated_frac": sum(s.status is SampleStatus.TRUNCATED for s in samples) / n,
        "aborted_frac": sum(s.status is SampleStatus.ABORTED for s in samples) / n,
    }
