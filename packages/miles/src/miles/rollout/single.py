"""One sample, one generate call: the per-sample unit the asynchronous producer schedules."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from typing import Any

from miles_rollout import (
    EngineClient,
    RewardFn,
    Sample,
    SampleStatus,
    SamplingParams,
    encode_prompt,
)

__all__ = ["generate_sample"]

logger = logging.getLogger(__name__)

_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}


async def generate_sample(
    client: EngineClient,
    tokenizer: Any,
    sample: Sample,
    *,
    sampling_params: SamplingParams,
    reward_fn: RewardFn,
) -> Sample:
    """Generate ``sample``'s response from its prompt and grade it, in place.

    An engine or reward error does not raise: the sample is marked ``FAILED`` with the reason
    in ``metadata["error"]`` (its group is then dropped, see ``build_train_batch``).
    """
    try:
        prompt_ids = encode_prompt(tokenizer, sample.prompt)
        out = await client.generate(prompt_ids, sampling_params, return_logprob=True)
        ids = list(out.output_ids)
        logprobs = list(out.output_logprobs or [])
        if len(logprobs) != len(ids):
            raise RuntimeError(f"engine returned {len(ids)} tokens but {len(logprobs)} logprobs")
        sample.tokens = prompt_ids + ids
        sample.response_length = len(ids)
        sample.loss_mask = [1] * len(ids)
        sample.rollout_logprobs = logprobs
        sample.response = tokenizer.decode(ids, skip_special_tokens=True)
        per_token = out.output_weight_versions
        sample.weight_versions = list(per_token or [out.weight_version] * len(ids))
        sample.metadata["finish_reason"] = out.finish_reason.type
        sample.status = _STATUS.get(out.finish_reason.type, SampleStatus.ABORTED)
        if sample.status is SampleStatus.ABORTED:
            return sample
        value = reward_fn(sample)
        if inspect.isawaitable(value):
            value = await value
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"reward function returned {reward!r}")
        sample.reward = reward
    except asyncio.CancelledError:
        raise
    except Exception as e:
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.metadata["error"] = repr(e)
        logger.warning("sample %d/%d failed: %r", sample.group_index, sample.index, e)
    return sample
