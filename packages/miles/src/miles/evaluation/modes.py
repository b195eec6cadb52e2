"""The three evaluation modes (``eval.mode``): shared engines, a dedicated engine, external.

- ``shared``: the held-out set runs on the rollout engines at the eval step itself; an async
  producer stops starting new samples meanwhile.
- ``dedicated``: a separate engine (embedded here, or ``eval.engine_url``) loads a checkpoint
  snapshot of the eval step in a background thread while training goes on; its row lands
  later, with ``eval/lag_steps`` (how many trainer steps late).
- ``external``: a user function ``fn(checkpoint_dir) -> dict[str, float] | None`` (``None`` or
  raising ``miles.SkipEval`` skips) runs on the snapshot in a background thread.

Each result is its own ``metrics.jsonl`` row: ``{"step": eval step, "eval/...": ...}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles.evaluation.run import evaluate, heldout_prompts
from miles.rollout.engines import RolloutEngines
from miles_rollout import Engine, PromptItem, SGLangClient

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["Evaluator", "SharedEval", "SkipEval", "SnapshotEval"]

logger = logging.getLogger(__name__)


class SkipEval(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by an external evaluator to skip a checkpoint."""


class Evaluator(Protocol):
    """What the loop calls at eval steps (rank 0)."""

    needs_snapshot: bool

    def evaluate(self, step: int, snapshot: Path | None) -> list[dict[str, Any]]:
        """Start (or run) the evaluation of ``step``; return the rows that are ready now."""
        ...

    def poll(self, step: int) -> list[dict[str, Any]]:
        """Rows that landed since the last call; ``step`` is the trainer's step now."""
        ...

    def finish(self, step: int) -> list[dict[str, Any]]:
        """Wait for every pending evaluation; return their rows."""
        ...

    def close(self) -> None:
        """Release engines and threads."""
        ...


def _row(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    return {"step": step, **{f"eval/{k}": v for k, v in metrics.items()}}


class SharedEval:
    """``eval.mode: shared``: the held-out set on the rollout engines, at the eval step."""

    needs_snapshot = False

    def __init__(self, cfg: RunConfig, engines: RolloutEngines, pause: Any = None) -> None:
        self.cfg = cfg
        self.engines = engines
        self.pause = pause  # the async source (pause_admission / resume_admission) or None
        self.items: list[PromptItem] = heldout_prompts(engines.task, cfg.eval.num_prompts)
        self._loop = asyncio.new_event_loop()

    async def _run(self) -> dict[str, float]:
        async with self.engines.client() as client:
            return await evaluate(
                client,
                self.engines.tokenizer,
                self.items,
                sampling_params=self.cfg.sampling,
                reward_fn=self.engines.reward_fn,
                sampled_n=self.cfg.eval.sampled_n,
                max_concurrency=self.cfg.rollout.max_concurrency,
                reward_errors=self.cfg.task.reward_errors,
            )

    def evaluate(self, step: int, snapshot: Path | None) -> list[dict[str, Any]]:
        if self.pause is not None:
            self.pause.pause_admission()
        try:
            return [_row(step, self._loop.run_until_complete(self._run()))]
        finally:
            if self.pause is not None:
                self.pause.resume_admission()

    def poll(self, step: int) -> list[dict[str, Any]]:
        return []

    def finish(self, step: int) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        self._loop.close()


class SnapshotEval:
    """``eval.mode: dedicated`` or ``external``: a worker thread evaluates checkpoint snapshots.

    Args:
        cfg: the run.
        task: the task (held-out prompts and its reward, for ``dedicated``).
        reward_fn: the run's reward function (``dedicated``).
        tokenizer: the policy's tokenizer (``dedicated``).
        external: the user evaluator (``external``); ``None`` means ``dedicated``.
    """

    needs_snapshot = True

    def __init__(
        self,
        cfg: RunConfig,
        *,
        task: Any,
        reward_fn: Any,
        tokenizer: Any,
        external: Callable[[str], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.external = external
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.items = [] if external is not None else heldout_prompts(task, cfg.eval.num_prompts)
        self.engine: Engine | None = None
        if external is None and cfg.eval.engine_url is None:
            # A second embedded engine, on one thread of its own (see RolloutEngines).
            self.engine = Engine(dataclasses.replace(cfg.engine, num_threads=1))
        self._todo: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._done: queue.Queue[dict[str, Any]] = queue.Queue()
        self._trainer_step = 0
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="miles-eval", daemon=True)
        self._thread.start()

    def _client(self) -> Any:
        from miles_rollout import LocalEngineClient

        if self.engine is not None:
            return LocalEngineClient(self.engine)
        assert self.cfg.eval.engine_url is not None
        from miles_rollout.auth import resolve_api_key

        return SGLangClient(
            self.cfg.eval.engine_url, api_key=resolve_api_key(self.cfg.rollout.api_key)
        )

    async def _dedicated(self, step: int, path: Path) -> dict[str, Any]:
        async with self._client() as client:
            await client.update_weights_from_disk(str(path), weight_version=str(step))
            return await evaluate(
                client,
                self.tokenizer,
                self.items,
                sampling_params=self.cfg.sampling,
                reward_fn=self.reward_fn,
                sampled_n=self.cfg.eval.sampled_n,
                reward_errors=self.cfg.task.reward_errors,
            )

    def _work(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while (job := self._todo.get()) is not None:
                step, path = job
                try:
                    if self.external is not None:
                        metrics = self.external(str(path))
                        if metrics is None:
                            raise SkipEval("the evaluator returned None")
                        metrics = dict(metrics)
                    else:
                        metrics = loop.run_until_complete(self._dedicated(step, path))
                except SkipEval as e:
                    metrics = {"skipped": 1.0}
                    logger.info("evaluation of step %d skipped: %s", step, e)
                except Exception as e:
                    metrics = {"failed": 1.0}
                    logger.warning("evaluation of step %d failed: %r", step, e)
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                with self._lock:
                    metrics["lag_steps"] = self._trainer_step - step
                # Put before counting it done, so finish() never sees neither.
                self._done.put(_row(step, metrics))
                with self._lock:
                    self._pending -= 1
        finally:
            loop.close()

    def evaluate(self, step: int, snapshot: Path | None) -> list[dict[str, Any]]:
        assert snapshot is not None
        with self._lock:
            self._trainer_step = step
            self._pending += 1
        self._todo.put((step, snapshot))
        return self.poll(step)

    def poll(self, step: int) -> list[dict[str, Any]]:
        with self._lock:
            self._trainer_step = step
        rows = []
        while True:
            try:
                rows.append(self._done.get_nowait())
            except queue.Empty:
                return rows

    def finish(self, step: int) -> list[dict[str, Any]]:
        rows = self.poll(step)
        while True:
            with self._lock:
                if self._pending == 0 and self._done.empty():
                    return rows
            rows.append(self._done.get())

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=120)
        if self.engine is not None:
            self.engine.shutdown()
