"""Grading one sample with a reward function, and what happens when the function fails.

A reward function that raises is a failure of that sample; the policy (``on_error``) decides
what the rollout does with it:

- ``"fail"``: raise :class:`RewardError` (the run stops with the message).
- ``"zero"``: the sample gets reward 0.0 and trains; ``metadata["reward_error"]`` says why.
- ``"drop"``: the sample is marked ``FAILED`` (its group is dropped before training).

A function that returns something that is not a number (``None``, a string, a dict) has broken
its contract (``miles_rollout.types.RewardFn``) rather than failed on one sample, so that
raises :class:`RewardError` under every policy. Every message names the function and the
sample (prompt, sample index, short excerpts of prompt and response).
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections import Counter
from typing import Any

from miles_rollout.sample import Sample, SampleStatus
from miles_rollout.types import RewardFn

__all__ = ["REWARD_ERROR_POLICIES", "RewardError", "callable_name", "describe_sample", "grade"]

logger = logging.getLogger(__name__)

REWARD_ERROR_POLICIES = ("fail", "zero", "drop")
_LOG_FIRST = 5  # failures logged in full per function; after that every _LOG_EVERY-th
_LOG_EVERY = 100
_failures: Counter[str] = Counter()
_failures_lock = threading.Lock()


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not a number.

    Attributes:
        function: the function's dotted name.
    """

    def __init__(self, message: str, *, function: str) -> None:
        super().__init__(message)
        self.function = function


def callable_name(fn: Any) -> str:
    """``module:qualname`` of a function (or its ``reward_name`` attribute when it has one)."""
    named = getattr(fn, "reward_name", None)
    if isinstance(named, str):
        return named
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}:{qualname}"


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _excerpt(text: str, limit: int = 60) -> str:
    return repr(_cut(text, limit))


def describe_sample(sample: Sample) -> str:
    """``prompt 3 (id q-17) sample 1: prompt '12+7=', response '19'`` for error messages."""
    prompt = sample.prompt
    if not isinstance(prompt, str):
        prompt = str(prompt[-1].get("content", "")) if prompt else ""
    pid = sample.metadata.get("id", sample.metadata.get("prompt_id"))
    ident = f" (id {pid})" if pid is not None else ""
    return (
        f"prompt {sample.group_index}{ident} sample {sample.index}: prompt {_excerpt(prompt)}, "
        f"response {_excerpt(sample.response)}"
    )


def _log_failure(name: str, message: str) -> None:
    with _failures_lock:
        _failures[name] += 1
        n = _failures[name]
    if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
        more = f" ({n} failures of this function so far)" if n > _LOG_FIRST else ""
        logger.warning("%s%s", message, more)


async def grade(sample: Sample, reward_fn: RewardFn, *, on_error: str = "fail") -> None:
    """Set ``sample.reward`` from ``reward_fn`` (sync or async), applying ``on_error`` when it
    raises or returns a non-finite number.

    Raises:
        RewardError: the function returned something that is not a number (any policy), or it
            failed and ``on_error`` is ``"fail"``.
        ValueError: ``on_error`` is not one of ``REWARD_ERROR_POLICIES``.
    """
    if on_error not in REWARD_ERROR_POLICIES:
        raise ValueError(f"on_error must be one of {list(REWARD_ERROR_POLICIES)}, got {on_error!r}")
    name = callable_name(reward_fn)
    try:
        value = reward_fn(sample)
        if inspect.isawaitable(value):
            value = await value
    except Exception as e:
        failure = f"reward function {name} raised {_cut(repr(e), 160)} on {describe_sample(sample)}"
        _apply(sample, name, failure, on_error, cause=e)
        return
    if isinstance(value, str) or not hasattr(type(value), "__float__"):
        raise RewardError(
            f"reward function {name} returned {type(value).__name__} {_cut(repr(value), 40)} "
            f"on {describe_sample(sample)}; a reward function must return a float "
            "(miles_rollout.types.RewardFn: fn(sample) -> float, or an awaitable of one)",
            function=name,
        )
    reward = float(value)
    if not math.isfinite(reward):
        failure = f"reward function {name} returned {reward!r} on {describe_sample(sample)}"
        _apply(sample, name, failure, on_error, cause=None)
        return
    sample.reward = reward


def _apply(
    sample: Sample, name: str, failure: str, on_error: str, *, cause: BaseException | None
) -> None:
    if on_error == "fail":
        raise RewardError(
            f"{failure} (reward_errors=fail; in a recipe, task.reward_errors: zero or drop "
            "keeps the run going)",
            function=name,
        ) from cause
    sample.metadata["reward_error"] = failure
    if on_error == "zero":
        sample.reward = 0.0
    else:
        sample.reward = None
        sample.status = SampleStatus.FAILED
        sample.metadata["error"] = failure
    _log_failure(name, f"{failure} (counted; reward_errors={on_error})")
