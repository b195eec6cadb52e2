"""One sample through the recipe's generate function, then graded: the per-sample unit the
asynchronous producer schedules."""

from __future__ import annotations

import asyncio
import logging

from miles_rollout import GenerateContext, GenerateFn, RewardFn, Sample, SampleStatus
from miles_rollout.rollout import grade

__all__ = ["generate_sample"]

logger = logging.getLogger(__name__)


async def generate_sample(
    ctx: GenerateContext, sample: Sample, *, generate_fn: GenerateFn, reward_fn: RewardFn
) -> Sample:
    """Generate ``sample``'s trajectory with ``generate_fn`` and grade it, in place.

    An engine, agent or reward error does not raise: the sample is marked ``FAILED`` with the
    reason in ``metadata["error"]`` (its group is then dropped, see ``build_train_batch``).
    """
    try:
        sample = await generate_fn(ctx, sample)
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            await grade(sample, reward_fn)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.metadata["error"] = repr(e)
        logger.warning("sample %d/%d failed: %r", sample.group_index, sample.index, e)
    return sample
