"""A deadline for reward functions: a hung reward fails its sample instead of the run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RewardTimeoutError", "with_timeout"]


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within its deadline."""


def _name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}:{qual}" if module else qual


async def _in_thread(fn: Callable[[Any], Any], sample: Any) -> Any:
    """Run ``fn(sample)`` in a daemon thread (a hung call then neither blocks the event loop
    nor the interpreter's exit, which a ThreadPoolExecutor worker would)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            result: tuple[bool, Any] = (True, fn(sample))
        except BaseException as e:  # delivered to the awaiting coroutine
            result = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop is gone: abandoned at its deadline
            loop.call_soon_threadsafe(deliver, *result)

    threading.Thread(target=work, name="miles-reward", daemon=True).start()
    return await fut


def with_timeout(fn: Callable[[Any], Any], timeout_s: float | None) -> Callable[[Any], Any]:
    """``fn`` (sync or async) as an async reward function that raises
    :class:`RewardTimeoutError` after ``timeout_s`` seconds (``None``: ``fn`` unchanged).

    A sync function runs in its own daemon thread, so one that hangs cannot stall the other
    samples' rollout; Python cannot stop that thread, it is abandoned (keep rewards that can
    hang, such as code execution, in a sandbox with its own limits: ``code_tests``).
    """
    if timeout_s is None:
        return fn
    if not timeout_s > 0:
        raise ValueError(f"task.reward_timeout_s must be > 0 (or null for none), got {timeout_s}")
    name = _name(fn)

    @functools.wraps(fn)
    async def timed(sample: Any) -> Any:
        async def call() -> Any:
            if inspect.iscoroutinefunction(fn):
                value = await fn(sample)
            else:
                value = await _in_thread(fn, sample)
            if inspect.isawaitable(value):
                value = await value
            return value

        try:
            return await asyncio.wait_for(call(), timeout_s)
        except TimeoutError:
            raise RewardTimeoutError(
                f"reward function {name} did not return within {timeout_s:g} s "
                "(task.reward_timeout_s)"
            ) from None

    return timed
