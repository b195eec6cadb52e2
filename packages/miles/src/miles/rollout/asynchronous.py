"""The asynchronous rollout: engines keep generating while the trainer trains.

A producer thread (its own asyncio loop) keeps ``rollout.max_concurrency`` samples in flight.
Scheduling is per sample: when a sample finishes, a waiting sample of another group takes its
slot at once. A group is complete when all of its samples are; completed groups enter a bounded
buffer in completion order, and the producer stops starting groups while the buffer is full.
Weight updates land between engine steps, so a generation in flight continues under the new
weights (a partial rollout); every token records the version that produced it.

``next_batch(step)`` takes ``prompts_per_step`` groups in completion order and applies the
staleness rule to each (staleness = the trainer's version minus the oldest token version of the
group): keep, retry (regenerate the prompt under current weights), drop, or a user function.
``reject`` refuses groups already over the bound when they complete. With admission pacing
(AReaL's rule) new prompts start only while ``accepted + running <= (max_staleness + version +
1) * prompts_per_step``, which bounds staleness without throwing slow samples away.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles.protocols import RolloutBatch
from miles.rollout.buffer import (
    CompletedGroup,
    GroupBuffer,
    GroupView,
    decide_staleness,
    group_min_version,
)
from miles.rollout.engines import RolloutEngines
from miles.rollout.single import generate_sample
from miles_rollout import GenerateContext, PromptItem, Sample, SampleStatus, rollout_metrics

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["AsyncRollout"]

logger = logging.getLogger(__name__)


class _OpenGroup:
    __slots__ = ("done", "item", "retries", "samples")

    def __init__(self, item: PromptItem, n: int, retries: int, index: int) -> None:
        self.item = item
        self.retries = retries
        self.samples = [
            Sample(
                group_index=index,
                index=i,
                prompt=item.messages,
                label=item.label,
                metadata=dict(item.metadata),
            )
            for i in range(n)
        ]
        self.done = 0


class AsyncRollout:
    """A ``RolloutSource`` whose producer runs ahead of the trainer (``rollout.mode: async``).

    Args:
        cfg: the run.
        engines: the engines to generate with (built from ``cfg`` when ``None``).
        staleness_fn: the user rule when ``rollout.staleness_policy`` is a dotted path.
    """

    def __init__(
        self,
        cfg: RunConfig,
        engines: RolloutEngines | None = None,
        *,
        staleness_fn: Callable[[GroupView], str] | None = None,
    ) -> None:
        self.cfg = cfg
        r = cfg.rollout
        self.engines = engines if engines is not None else RolloutEngines(cfg)
        self.n = r.n_samples_per_prompt
        self.batch = r.prompts_per_step
        self.max_staleness = r.max_staleness
        self.policy = r.staleness_policy
        self.staleness_fn = staleness_fn
        self.buffer = GroupBuffer(r.buffer_capacity or 2 * r.prompts_per_step)
        self._version = 0  # completed weight updates (the trainer's version)
        self._lock = threading.Lock()
        self._retry_queue: collections.deque[tuple[PromptItem, int]] = collections.deque()
        self._refused = 0  # groups taken from the buffer but retried or dropped
        self._open = 0  # groups in flight
        self._in_flight = 0  # samples in flight
        self._started = 0  # groups started (also the group index)
        self._done_in_open = 0  # finished samples of groups still in flight
        self._counts = collections.Counter[str]()
        self._idle_s = 0.0  # time with no sample in flight, since the last batch
        self._idle_since: float | None = time.perf_counter()
        self._window_start = time.perf_counter()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._admission_paused = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open_groups: dict[int, _OpenGroup] = {}
        self._thread = threading.Thread(target=self._run, name="miles-rollout", daemon=True)

    def start(self) -> None:
        """Start the producer (the first ``next_batch`` does it too); idempotent."""
        if not self._thread.is_alive() and not self._stop.is_set() and self._thread.ident is None:
            self._thread.start()

    # ---- producer (its own thread and event loop) --------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._produce())
        except BaseException as e:  # reported to the trainer by the next get
            if not self._stop.is_set():
                logger.exception("the rollout producer failed")
                self.buffer.fail(e)
        finally:
            loop.close()

    def _may_admit(self) -> bool:
        if self._stop.is_set() or self._admission_paused or not self.buffer.has_room():
            return False
        # Keep one group's worth of samples waiting behind the slots, so a freed slot is
        # refilled at once (per-sample scheduling) without starting unboundedly many groups.
        if self._in_flight_or_waiting() >= self.cfg.rollout.max_concurrency + self.n:
            return False
        if self.cfg.rollout.admission_pacing:
            # Taken-then-refused groups leave the count only after the decision, so the count
            # errs high for a moment (fewer admissions), never low.
            accepted = self.buffer.seen() - self._refused
            limit = (self.max_staleness + self._version + 1) * self.batch
            if accepted + self._open >= limit:
                return False
        return True

    def _in_flight_or_waiting(self) -> int:
        return self._open * self.n - self._done_in_open

    async def _produce(self) -> None:
        self._wake = asyncio.Event()
        slots = asyncio.Semaphore(self.cfg.rollout.max_concurrency)
        tasks: set[asyncio.Task[None]] = set()
        async with contextlib.AsyncExitStack() as stack:
            client = self.engines.client()
            await stack.enter_async_context(client)
            ctx = await self.engines.generate_context(client, stack)
            try:
                while not self._stop.is_set():
                    while self._may_admit():
                        group = self._next_group()
                        for s in group.samples:
                            t = asyncio.ensure_future(self._one(ctx, group, s, slots))
                            tasks.add(t)
                            t.add_done_callback(tasks.discard)
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                    if self._failure is not None:
                        raise self._failure
            finally:
                for t in tasks:
                    t.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)

    def _next_group(self) -> _OpenGroup:
        with self._lock:
            if self._retry_queue:
                item, retries = self._retry_queue.popleft()
            else:
                item, retries = self.engines.draw(1)[0], 0
            group = _OpenGroup(item, self.n, retries, self._started)
            self._started += 1
            self._open += 1
            self._open_groups[id(group)] = group
        return group

    async def _one(
        self, ctx: GenerateContext, group: _OpenGroup, sample: Sample, slots: asyncio.Semaphore
    ) -> None:
        try:
            await self._one_inner(ctx, group, sample, slots)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug: stop the producer, the trainer's get raises it
            self._failure = e
            assert self._wake is not None
            self._wake.set()

    async def _one_inner(
        self, ctx: GenerateContext, group: _OpenGroup, sample: Sample, slots: asyncio.Semaphore
    ) -> None:
        async with slots:
            self._busy(+1)
            try:
                await generate_sample(
                    ctx,
                    sample,
                    generate_fn=self.engines.generate_fn,
                    reward_fn=self.engines.reward_fn,
                    reward_errors=self.cfg.task.reward_errors,
                )
            finally:
                self._busy(-1)
        group.done += 1
        self._done_in_open += 1
        if sample.status is SampleStatus.FAILED:
            with self._lock:
                self._counts["failed_samples"] += 1
        if group.done == len(group.samples):
            self._complete(group)
        assert self._wake is not None
        self._wake.set()

    def _busy(self, delta: int) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._in_flight == 0 and delta > 0 and self._idle_since is not None:
                self._idle_s += now - self._idle_since
                self._idle_since = None
            self._in_flight += delta
            if self._in_flight == 0:
                self._idle_since = now

    def _complete(self, group: _OpenGroup) -> None:
        done = CompletedGroup(
            item=group.item,
            samples=group.samples,
            retries=group.retries,
            completed_at=time.perf_counter(),
        )
        # Under the lock, so a state_dict() sees the group either open or buffered.
        with self._lock:
            self._open -= 1
            self._done_in_open -= len(group.samples)
            del self._open_groups[id(group)]
            lo = group_min_version(group.samples)
            if (
                self.policy == "reject"
                and lo is not None
                and self._version - lo > self.max_staleness
            ):
                self._counts["rejected"] += 1
                return
            self.buffer.put(done)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    # ---- consumer (the loop's thread) --------------------------------------------------------

    def _decide(self, group: CompletedGroup, version: int) -> str:
        decision, failed = decide_staleness(
            group.view(version),
            max_staleness=self.max_staleness,
            policy=self.policy,
            fn=self.staleness_fn,
            fallback=self.cfg.rollout.staleness_fallback,
        )
        if failed:
            with self._lock:
                self._counts["staleness_fn_errors"] += 1
        return decision

    def next_batch(self, step: int) -> RolloutBatch:
        """Take ``prompts_per_step`` groups in completion order, applying the staleness rule."""
        t0 = time.perf_counter()
        self.start()
        version = self._version
        groups: list[list[Sample]] = []
        staleness: list[int] = []
        while len(groups) < self.batch:
            group = self.buffer.get()
            self._poke()  # room in the buffer: the producer may start groups again
            decision = self._decide(group, version)
            if decision == "retry":
                with self._lock:
                    self._counts["retried"] += 1
                    self._refused += 1
                    self._retry_queue.append((group.item, group.retries + 1))
                continue
            if decision == "drop":
                with self._lock:
                    self._counts["dropped"] += 1
                    self._refused += 1
                continue
            lo = group_min_version(group.samples)
            stale = version - lo if lo is not None else 0
            for i, s in enumerate(group.samples):
                s.group_index = len(groups)
                s.index = i
                s.metadata["staleness"] = stale
            groups.append(group.samples)
            staleness.append(stale)
        with self._lock:
            now = time.perf_counter()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0)
            window = max(now - self._window_start, 1e-9)
            self._idle_s = 0.0
            if self._idle_since is not None:
                self._idle_since = now
            self._window_start = now
            counts = dict(self._counts)
            self._counts.clear()
        metrics = rollout_metrics([s for g in groups for s in g])
        metrics.update(
            buffer_groups=float(len(self.buffer)),
            engine_idle_frac=idle / window,
            staleness_mean=sum(staleness) / len(staleness),
            staleness_max=float(max(staleness)),
            retried=float(counts.get("retried", 0)),
            dropped=float(counts.get("dropped", 0)),
            rejected=float(counts.get("rejected", 0)),
            staleness_fn_errors=float(counts.get("staleness_fn_errors", 0)),
            failed_samples=float(counts.get("failed_samples", 0)),
        )
        for k, c in collections.Counter(staleness).items():
            metrics[f"staleness_hist_{k}"] = float(c)
        return RolloutBatch(groups=groups, metrics=metrics, seconds=time.perf_counter() - t0)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the buffered groups (complete samples) and the prompts of
        groups in flight or waiting for a retry (regenerated from scratch after a resume)."""
        with self._lock:
            return {
                "buffered": [
                    {"item": g.item, "samples": g.samples, "retries": g.retries}
                    for g in self.buffer.snapshot()
                ],
                "pending": [(g.item, g.retries) for g in self._open_groups.values()]
                + list(self._retry_queue),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` before the producer starts."""
        assert self._thread.ident is None, "load_state_dict before the producer starts"
        for g in state["buffered"]:
            group = CompletedGroup(
                item=g["item"], samples=g["samples"], retries=g["retries"], completed_at=0.0
            )
            self.buffer.put(group)
        self._retry_queue.extend(state["pending"])

    def pause_admission(self) -> None:
        """Start no new samples (those in flight go on), e.g. while an eval set runs on the
        same engines."""
        self._admission_paused = True

    def resume_admission(self) -> None:
        """Start samples again after :meth:`pause_admission`."""
        self._admission_paused = False
        self._poke()

    def weights_updated(self, version: int) -> None:
        """The engines serve ``version`` now: pacing may admit more, staleness is measured
        against it."""
        with self._lock:
            self._version = version
        self._poke()

    def close(self) -> None:
        """Stop the producer (cancelling what is in flight) and the engines."""
        if not self._stop.is_set():
            self._stop.set()
            self._poke()
            self._thread.join(timeout=60)
            self.buffer.close()
        self.engines.close()
