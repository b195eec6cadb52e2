"""Resolve a run's task (prompts + reward) and optional custom reward function by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from miles.config import TaskSettings
from miles_rollout import Sample
from miles_rollout.tasks import ArithmeticTask, DatasetTask, GuessNumberTask, WordProblemTask
from miles_rollout.types import PromptItem, Task  # the types live in miles-rollout now

__all__ = ["PromptItem", "Task", "load_callable", "make_reward_fn", "make_task"]


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "guess_number": GuessNumberTask,  # multi-turn: pair it with the agent guess_number.play
    "dataset": DatasetTask,  # JSONL / JSON / Parquet / datasets dir + template + label field
    "word_problems": WordProblemTask,  # seeded multi-step word problems (small LMs)
}


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` (or ``"package.module.attr"``) and return it."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def make_task(settings: TaskSettings) -> Task:
    """Build the task named by ``settings.name`` with ``settings.params``."""
    factory = BUILTIN_TASKS.get(settings.name) or load_callable(settings.name)
    try:
        return factory(**settings.params)
    except TypeError as e:
        raise ValueError(f"task {settings.name!r}: bad params {settings.params}: {e}") from e


def make_reward_fn(settings: TaskSettings, task: Task) -> Callable[[Sample], Any]:
    """``settings.reward_fn`` when given, else the task's own ``reward(response, label)``."""
    if settings.reward_fn:
        return load_callable(settings.reward_fn)
    return lambda sample: task.reward(sample.response, sample.label)
