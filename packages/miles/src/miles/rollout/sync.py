"""The synchronous rollout: each trainer step generates its own groups with the current weights."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from miles.protocols import RolloutBatch
from miles.rollout.engines import RolloutEngines
from miles_rollout import RolloutResult, generate_rollout, rollout_metrics

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["SyncRollout"]


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over their sequence)."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class SyncRollout:
    """A ``RolloutSource`` that generates ``prompts_per_step`` groups when asked, then idles.

    Every sample of a step is produced by the weights of the previous step (staleness 0).
    """

    def __init__(self, cfg: RunConfig, engines: RolloutEngines | None = None) -> None:
        self.cfg = cfg
        self.engines = engines if engines is not None else RolloutEngines(cfg)
        # One event loop for the whole run, not asyncio.run() per step: on exit asyncio.run
        # restores the SIGINT handler, and signal.getsignal/signal format repr() of the
        # finished main task, i.e. of the whole RolloutResult, every step (O(rollout size):
        # 11 ms at 64 samples x 88 tokens, 0.5 s at 512 x 1k tokens).
        self._loop = asyncio.new_event_loop()
        self._closed = False

    async def _generate(self, step: int) -> RolloutResult:
        cfg = self.cfg
        items = self.engines.draw(cfg.rollout.prompts_per_step)
        if cfg.run.deterministic:
            # Seeded per request from (seed, step, group): sampling then depends on nothing
            # else (not on the engine's own random stream), so a resumed run samples the same.
            for gi, item in enumerate(items):
                item.metadata["sampling_seed"] = _mix(cfg.engine.seed, step, gi)
        async with contextlib.AsyncExitStack() as stack:
            client = self.engines.client()
            await stack.enter_async_context(client)
            ctx = await self.engines.generate_context(client, stack)
            return await generate_rollout(
                client,
                self.engines.tokenizer,
                items,
                n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                sampling_params=cfg.sampling,
                reward_fn=self.engines.reward_fn,
                max_concurrency=cfg.rollout.max_concurrency,
                reward_errors=cfg.task.reward_errors,
                generate_fn=self.engines.generate_fn,
                context=ctx,
            )

    def next_batch(self, step: int) -> RolloutBatch:
        """Generate and grade this step's groups."""
        result = self._loop.run_until_complete(self._generate(step))
        return RolloutBatch(
            groups=result.groups, metrics=rollout_metrics(result.samples), seconds=result.seconds
        )

    def weights_updated(self, version: int) -> None:
        """Nothing to do: the next step generates with whatever the engines serve."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing beyond the data position (the engines' counter) to resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`state_dict`."""

    def close(self) -> None:
        """Cancel what is left on the event loop, close it and stop the engines."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        try:
            # What asyncio.run does on exit: cancel what is left (after an error or Ctrl-C;
            # cancelling drops the requests from the engine), then shut the loop down.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
            self.engines.close()
