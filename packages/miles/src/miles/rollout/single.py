"""One sample through the recipe's generate function, then graded: the per-sample unit the
asynchronous producer schedules."""

from __future__ import annotations

import asyncio
import logging

from miles_rollout import GenerateContext, GenerateFn, RewardFn, Sample, SampleStatus
from miles_rollout.reward import RewardError, grade

__all__ = ["generate_sample"]

logger = logging.getLogger(__name__)


async def generate_sample(
    ctx: GenerateContext,
    sample: Sample,
    *,
    generate_fn: GenerateFn,
    reward_fn: RewardFn,
    reward_errors: str = "drop",
) -> Sample:
    """Generate ``sample``'s trajectory with ``generate_fn`` and grade it, in place.

    An engine or agent error does not raise: the sample is marked ``FAILED`` with the reason
    in ``metadata["error"]`` (its group is then dropped, see ``build_train_batch``). A reward
    function that fails is handled by ``reward_errors`` exactly as in ``generate_rollout``
    (``miles_rollout.reward.grade``): drop, zero, or fail (``RewardError`` is raised).
    """
    try:
        sample = await generate_fn(ctx, sample)
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            await grade(sample, reward_fn, on_error=reward_errors)
    except (asyncio.CancelledError, RewardError):
        raise
    except Exception as e:
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.metadata["error"] = repr(e)
        logger.warning("sample %d/%d failed: %r", sample.group_index, sample.index, e)
    return sample
