"""Resolve a run's task (prompts + reward) and optional custom reward function by name.

A recipe names a task by a built-in name (``BUILTIN_TASKS``) or a dotted path
``"package.module:factory"`` to a ``miles_rollout.types.TaskFactory`` (``factory(**params) ->
Task``), and optionally a ``RewardFn`` by dotted path. Modules are imported from the installed
packages first, then from the recipe's directory and the working directory. A factory that
returns something other than a ``Task``, or a task whose ``sample(n)`` yields something other
than ``PromptItem``s, stops the run with a message naming it and the expected type.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
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
    "harbor": lambda **p: _agentic().HarborTaskSet(**p),  # Harbor task dirs (miles.agentic)
    "verifiers": lambda **p: _agentic().VerifiersTaskSet(**p),  # a Verifiers taskset
    "hud": lambda **p: _agentic().HudTaskSet(**p),  # the task rows of a HUD environment
    "nemo_gym": lambda **p: _agentic().NemoGymTaskSet(**p),  # NeMo Gym JSONL task rows
}


def _agentic() -> Any:
    """miles.agentic, imported on use: it needs miles-env (pip install 'miles[env]')."""
    return importlib.import_module("miles.agentic")


_TASK_CONTRACT = (
    "an object with sample(n) -> list[PromptItem] and reward(response, label) -> float "
    "(miles_rollout.types.Task)"
)


def _import(module_name: str) -> Any:
    """Import ``module_name``; when it is not found, retry with the working directory appended
    to ``sys.path`` (appended: a local module never shadows an installed package).
    ``load_recipe`` appends the recipe's directory and the working directory up front."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):
            raise  # the module exists but one of its own imports is missing
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
    return importlib.import_module(module_name)


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` (or ``"package.module.attr"``) and return it; a module
    that is not installed is looked for in the working directory too.

    Raises:
        ValueError: not a dotted path, the module does not import, or no such callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module:function'")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import module {module_name!r} for {path!r}: {e} (looked in the installed "
            "packages, the recipe's directory and the working directory)"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


class _CheckedTask:
    """A task whose ``sample`` (and ``heldout``) results are checked to be ``PromptItem``s."""

    def __init__(self, task: Task, name: str) -> None:
        self._task = task
        self._name = name

    def _check(self, call: str, items: Any, n: int) -> list[PromptItem]:
        if not isinstance(items, list | tuple) or len(items) != n:
            raise ValueError(
                f"task {self._name!r}: {call}({n}) returned {type(items).__name__} "
                f"{_short(items)}; it must return a list of {n} miles_rollout.PromptItem"
            )
        for item in items:
            if not isinstance(item, PromptItem):
                raise ValueError(
                    f"task {self._name!r}: {call}({n}) returned a {type(item).__name__} "
                    f"{_short(item)}; each item must be a miles_rollout.PromptItem("
                    "messages=[{'role': 'user', 'content': ...}], label=...)"
                )
        return list(items)

    def sample(self, n: int) -> list[PromptItem]:
        return self._check("sample", self._task.sample(n), n)

    def reward(self, response: str, label: Any) -> float:
        return self._task.reward(response, label)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._task, name)
        if name == "heldout" and callable(value):
            return lambda n: self._check("heldout", value(n), n)
        return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_task(settings: TaskSettings) -> Task:
    """Build the task named by ``settings.name`` with ``settings.params``.

    Raises:
        ValueError: an unknown name (the message lists the built-in tasks), bad params, or a
            factory that does not return a ``Task``.
    """
    name = settings.name
    factory = BUILTIN_TASKS.get(name)
    if factory is None:
        if ":" not in name and "." not in name:
            raise ValueError(
                f"unknown task {name!r}: the built-in tasks are {', '.join(BUILTIN_TASKS)}; or "
                "give a dotted path 'package.module:factory' to factory(**params) returning "
                + _TASK_CONTRACT
            )
        factory = load_callable(name)
    try:
        task = factory(**settings.params)
    except TypeError as e:
        raise ValueError(f"task {name!r}: bad params {settings.params}: {e}") from e
    if not isinstance(task, Task):
        raise ValueError(
            f"task factory {name!r} returned {type(task).__name__} {_short(task)}; it must "
            f"return {_TASK_CONTRACT}"
        )
    if name in BUILTIN_TASKS:
        return task
    return _CheckedTask(task, name)


def make_reward_fn(settings: TaskSettings, task: Task) -> Callable[[Sample], Any]:
    """``settings.reward_fn`` when given, else the task's own ``reward(response, label)``.

    Raises:
        ValueError: the dotted path does not import, or the function does not take one
            argument (``miles_rollout.types.RewardFn``: ``fn(sample) -> float``).
    """
    if settings.reward_fn:
        fn = load_callable(settings.reward_fn)
        try:
            inspect.signature(fn).bind(None)
        except TypeError as e:
            raise ValueError(
                f"reward function {settings.reward_fn!r} cannot be called as fn(sample): {e}; "
                "a reward function takes one miles_rollout.Sample and returns a float "
                "(miles_rollout.types.RewardFn)"
            ) from e
        except ValueError:
            pass  # no signature to inspect (some builtins): it is checked when called
        return fn
    inner = task._task if isinstance(task, _CheckedTask) else task

    def task_reward(sample: Sample) -> float:
        return task.reward(sample.response, sample.label)

    task_reward.reward_name = (  # type: ignore[attr-defined]  # named in reward errors
        f"{type(inner).__module__}:{type(inner).__qualname__}.reward"
    )
    return task_reward
