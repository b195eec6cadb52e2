"""The engines a run generates with: the embedded engine in this process, or a URL."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from miles.rewards.timeout import with_timeout
from miles.tasks import make_reward_fn, make_task
from miles_rollout import Engine, LocalEngineClient, SGLangClient
from miles_transfer import HTTPReceiver, WeightReceiver

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["RolloutEngines"]


class RolloutEngines:
    """Rank 0's engines, tokenizer, task and reward function for one run.

    Args:
        cfg: the run; ``cfg.rollout.engine_url`` ``None`` starts the embedded engine here.

    Raises:
        FileNotFoundError: the model directory has no tokenizer (the rollout needs its chat
            template).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.task = make_task(cfg.task)
        self.reward_fn = with_timeout(make_reward_fn(cfg.task, self.task), cfg.task.reward_timeout_s)
        self.engine: Engine | None = None
        self.receiver: WeightReceiver
        if cfg.rollout.engine_url is None:
            engine_cfg = cfg.engine
            if engine_cfg.num_threads is None:
                # The embedded engine shares the process (and the cores) with the trainer. An
                # engine thread with its own multi-thread OpenMP team makes libgomp see more
                # threads than cores and stop spinning between parallel regions, so every op
                # of the train step then waits on futex wake-ups (measured: ~3,200 voluntary
                # context switches per `gen` train step and about 2x its time). One thread
                # decodes small models as fast as two. Set engine.num_threads to override.
                engine_cfg = dataclasses.replace(engine_cfg, num_threads=1)
            self.engine = Engine(engine_cfg)
            self.receiver = self.engine
            self.tokenizer: Any = self.engine.tokenizer
        else:
            self.receiver = HTTPReceiver(cfg.rollout.engine_url)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        if self.tokenizer is None:
            self.close()
            raise FileNotFoundError(
                f"{cfg.model_path} has no tokenizer files; the rollout needs the chat template"
            )

    def client(self) -> LocalEngineClient | SGLangClient:
        """A new client of the engines (use it as an async context manager)."""
        if self.engine is not None:
            return LocalEngineClient(self.engine)
        assert self.cfg.rollout.engine_url is not None
        return SGLangClient(self.cfg.rollout.engine_url)

    def close(self) -> None:
        """Shut the embedded engine down (idempotent)."""
        if self.engine is not None:
            self.engine.shutdown()
