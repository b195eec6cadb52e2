"""The engines a run generates with: the embedded engine in this process, or a URL."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from miles.rewards.timeout import with_timeout
from miles.rollout.fanout import FanoutReceiver
from miles.tasks import make_reward_fn, make_task
from miles_rollout import (
    Engine,
    EngineConfig,
    GenerateContext,
    GenerateFn,
    LocalEngineClient,
    PromptItem,
    SGLangClient,
    make_generate_fn,
)
from miles_rollout.auth import resolve_api_key
from miles_rollout.fleet import Fleet, FleetConfig
from miles_transfer import HTTPReceiver, WeightReceiver
from miles_transfer.push import ReceiverError

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["RolloutEngines"]


class RolloutEngines:
    """Rank 0's engines, tokenizer, task and reward function for one run.

    Args:
        cfg: the run: a ``fleet`` section starts engine processes behind sglang-router
            (weight updates go to every engine, generation through the router);
            ``rollout.engine_url`` uses running engines; otherwise the embedded engine runs
            in this process.

    Raises:
        FileNotFoundError: the model directory has no tokenizer (the rollout needs its chat
            template).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.task = make_task(cfg.task)
        self.prompts_drawn = 0  # training prompts taken from the task (the data position)
        self.reward_fn = with_timeout(
            make_reward_fn(cfg.task, self.task), cfg.task.reward_timeout_s
        )
        self.generate_fn: GenerateFn = make_generate_fn(
            cfg.rollout.generate_fn, agent=cfg.rollout.agent
        )
        self.engine: Engine | None = None
        self.fleet: Fleet | None = None
        self.url = cfg.rollout.engine_url
        # rollout.api_key, else $MILES_API_KEY: for the client, the pushes and the fleet.
        self.api_key = resolve_api_key(cfg.rollout.api_key)
        self.receiver: WeightReceiver
        if cfg.fleet is not None:
            fleet_cfg = _fleet_config(cfg)
            if fleet_cfg.api_key is None and self.api_key is not None:
                fleet_cfg = dataclasses.replace(fleet_cfg, api_key=self.api_key)
            self.api_key = fleet_cfg.api_key
            self.fleet = fleet_cfg.build().start()
            fleet = self.fleet
            self.url = fleet.url
            try:
                self.receiver = FanoutReceiver(lambda: fleet.engine_urls, api_key=self.api_key)
            except BaseException:
                fleet.close()
                raise
        elif cfg.rollout.engine_url is None:
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
        else:
            try:
                self.receiver = HTTPReceiver(cfg.rollout.engine_url, api_key=self.api_key)
            except ReceiverError as e:  # the first request: the engine is not there
                raise ValueError(
                    f"cannot reach the engine at rollout.engine_url={cfg.rollout.engine_url} "
                    f"({e}); start it first (miles-rollout serve, SGLang) or fix the URL"
                ) from e
        self.tokenizer: Any = self.engine.tokenizer if self.engine is not None else None
        if self.engine is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        if self.tokenizer is None:
            self.close()
            raise FileNotFoundError(
                f"{cfg.model_path} has no tokenizer files; the rollout needs the chat template"
            )

    def draw(self, n: int) -> list[PromptItem]:
        """The next ``n`` training prompts of the task (counted: the data position)."""
        items = list(self.task.sample(n))
        self.prompts_drawn += len(items)
        return items

    def skip(self, n: int) -> None:
        """Move the task's stream forward by ``n`` prompts (resuming a run)."""
        while n > 0:
            k = min(n, 1024)
            self.draw(k)
            n -= k

    def metrics(self) -> dict[str, float]:
        """The fleet's numbers (engines alive, deaths, sessions moved, ...), or nothing."""
        return self.fleet.metrics() if self.fleet is not None else {}

    async def generate_context(
        self, client: LocalEngineClient | SGLangClient, stack: contextlib.AsyncExitStack
    ) -> GenerateContext:
        """The context the generate function gets; starts a TITO session server in the
        running event loop (closed with ``stack``) when the generate function needs one."""
        sessions_url = None
        if getattr(self.generate_fn, "needs_sessions", False):
            from miles_rollout.session.server import start_sessions

            server = await start_sessions(
                client, tokenizer=self.tokenizer, return_routed_experts=self.cfg.trainer.r3
            )
            stack.push_async_callback(server.close)
            sessions_url = server.url
        return GenerateContext(
            client=client,
            tokenizer=self.tokenizer,
            sampling_params=self.cfg.sampling,
            sessions_url=sessions_url,
            return_routed_experts=self.cfg.trainer.r3,
        )

    def client(self) -> LocalEngineClient | SGLangClient:
        """A new client of the engines (use it as an async context manager)."""
        if self.engine is not None:
            return LocalEngineClient(self.engine)
        assert self.url is not None
        return SGLangClient(
            self.url,
            api_key=self.api_key,
            timeout=self.cfg.rollout.request_timeout_s,
            generate_retries=self.cfg.rollout.max_retries,
        )

    def close(self) -> None:
        """Shut the embedded engine or the fleet down (idempotent)."""
        if self.engine is not None:
            self.engine.shutdown()
        if self.fleet is not None:
            self.fleet.close()


# EngineConfig fields the fleet's embedded engines take from the recipe's `engine` section
# (as `miles-rollout serve` flags) unless `fleet.engine_args` sets them.
_ENGINE_FLAGS = ("dtype", "max_running_requests", "context_length", "seed", "num_threads")


def _fleet_config(cfg: RunConfig) -> FleetConfig:
    fleet = cfg.fleet
    assert fleet is not None
    if fleet.backend != "embedded":
        return fleet
    args = dict(fleet.engine_args)
    defaults = EngineConfig(model_path=cfg.model_path)
    for name in _ENGINE_FLAGS:
        value = getattr(cfg.engine, name)
        if name not in args and value is not None and value != getattr(defaults, name):
            args[name] = value
    return dataclasses.replace(fleet, engine_args=args)
