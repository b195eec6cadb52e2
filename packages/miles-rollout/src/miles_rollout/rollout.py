"""Rollout orchestration: turn prompts into graded groups of samples through any engine client.

The same code drives the embedded engine (``LocalEngineClient``) and SGLang servers
(``SGLangClient``). Each sample goes through a generate function (single-turn by default,
session-based multi-turn, or a user's own; see ``miles_rollout.types.GenerateFn``). Every sample
of a group is submitted at once, so the engine's continuous batching sees the whole rollout
batch; a semaphore bounds samples in flight. A generate function with ``needs_sessions`` gets a
TITO session server started in this event loop for the rollout (or the one at
``sessions_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_rollout.generate.single_turn import encode_prompt, single_turn_generate
from miles_rollout.reward import REWARD_ERROR_POLICIES, RewardError, grade
from miles_rollout.sample import Sample, SampleStatus
from miles_rollout.types import GenerateContext, GenerateFn, PromptItem, RewardFn

if TYPE_CHECKING:
    from miles_rollout.client import EngineClient
    from miles_rollout.sampling_params import SamplingParams

__all__ = [
    "RewardError",
    "RewardFn",
    "RolloutResult",
    "encode_prompt",
    "generate_rollout",
    "grade",
    "rollout_metrics",
]


@dataclass(kw_only=True, slots=True)
class RolloutResult:
    """Graded groups of one rollout step plus how long it took."""

    groups: list[list[Sample]]
    seconds: float

    @property
    def samples(self) -> list[Sample]:
        """All samples, group by group."""
        return [s for g in self.groups for s in g]


async def _run_one(
    generate_fn: GenerateFn,
    ctx: GenerateContext,
    sample: Sample,
    reward_fn: RewardFn,
    semaphore: asyncio.Semaphore,
    reward_errors: str,
) -> Sample:
    async with semaphore:
        sample = await generate_fn(ctx, sample)
    if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
        await grade(sample, reward_fn, on_error=reward_errors)
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
    generate_fn: GenerateFn | None = None,
    sessions_url: str | None = None,
    reward_errors: str = "fail",
    context: GenerateContext | None = None,
) -> RolloutResult:
    """Generate and grade ``n_samples_per_prompt`` samples for each prompt.

    Args:
        client: any engine client (embedded or SGLang over HTTP).
        tokenizer: the policy's HF tokenizer (chat template and decoding).
        items: prompts with their labels.
        n_samples_per_prompt: group size (GRPO's G).
        sampling_params: engine sampling parameters shared by every request.
        reward_fn: ``reward_fn(sample) -> float`` (sync or async); called once per finished sample.
        max_concurrency: bound on samples in flight.
        generate_fn: how a sample is generated (default: single-turn).
        sessions_url: an existing TITO session server for ``needs_sessions`` generate
            functions; by default one is started in this event loop for the rollout, in front
            of ``client``.
        context: the generate functions' context as the caller built it (its own session
            server, ``return_routed_experts``); ``client``, ``tokenizer`` and
            ``sampling_params`` are then taken from it and ``sessions_url`` is ignored.
        reward_errors: when ``reward_fn`` raises: ``"fail"`` (raise ``RewardError``),
            ``"zero"`` (reward 0.0) or ``"drop"`` (the sample is ``FAILED``); see
            ``miles_rollout.reward``. A non-number returned raises under every policy.

    Returns:
        The groups, in prompt order, each with ``n_samples_per_prompt`` samples.

    Raises:
        RewardError: see ``reward_errors``; the message names the function and the sample.
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if reward_errors not in REWARD_ERROR_POLICIES:
        raise ValueError(
            f"reward_errors must be one of {list(REWARD_ERROR_POLICIES)}, got {reward_errors!r}"
        )
    fn: GenerateFn = generate_fn if generate_fn is not None else single_turn_generate
    t0 = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        if context is not None:
            ctx = context
        else:
            if getattr(fn, "needs_sessions", False) and sessions_url is None:
                from miles_rollout.session.server import start_sessions

                server = await start_sessions(client, tokenizer=tokenizer)
                stack.push_async_callback(server.close)
                sessions_url = server.url
            ctx = GenerateContext(
                client=client,
                tokenizer=tokenizer,
                sampling_params=sampling_params,
                sessions_url=sessions_url,
            )
        semaphore = asyncio.Semaphore(max_concurrency)
        groups: list[list[Sample]] = []
        tasks = []
        for gi, item in enumerate(items):
            group = [
                Sample(
                    group_index=gi,
                    index=i,
                    prompt=item.messages,
                    label=item.label,
                    metadata=dict(item.metadata),
                )
                for i in range(n_samples_per_prompt)
            ]
            groups.append(group)
            tasks += [_run_one(fn, ctx, s, reward_fn, semaphore, reward_errors) for s in group]
        await asyncio.gather(*tasks)
    return RolloutResult(groups=groups, seconds=time.perf_counter() - t0)


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Summary numbers of one rollout step (reward over graded samples only).

    Also the mean of every finite number a generate or agent function reported in
    ``sample.metadata["metrics"]`` (a mapping), per key over the samples that report it:
    e.g. ``agentic/turns`` from ``miles_env.rollout.terminal_agent``.
    """
    graded = [s.reward for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    n = max(1, len(samples))
    out = {
        "reward_mean": sum(graded) / len(graded) if graded else float("nan"),
        "response_len_mean": sum(lengths) / n,
        "truncated_frac": sum(s.status is SampleStatus.TRUNCATED for s in samples) / n,
        "aborted_frac": sum(s.status is SampleStatus.ABORTED for s in samples) / n,
        "failed_frac": sum(s.status is SampleStatus.FAILED for s in samples) / n,
        "reward_errors": float(sum("reward_error" in s.metadata for s in samples)),
    }
    reported: dict[str, list[float]] = {}
    for s in samples:
        numbers = s.metadata.get("metrics")
        if isinstance(numbers, Mapping):
            for k, v in numbers.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                    reported.setdefault(str(k), []).append(float(v))
    for k, values in reported.items():
        out.setdefault(k, sum(values) / len(values))
    return out
