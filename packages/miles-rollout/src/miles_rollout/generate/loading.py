"""Generate functions by name: built-in ones and a user's own by dotted path."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from miles_rollout.types import GenerateFn

__all__ = ["is_async_callable", "load_callable", "make_generate_fn"]


def is_async_callable(fn: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` (or ``"package.module.attr"``) and return it.

    Raises:
        ValueError: the path is malformed, the module does not import, or the attribute is
            missing or not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def make_generate_fn(name: str | None = None, *, agent: str | None = None) -> GenerateFn:
    """The generate function a recipe names.

    Args:
        name: ``None`` or ``"single_turn"`` (one ``/generate`` per sample), ``"multi_turn"``
            (an agent in a TITO session; needs ``agent``), or a dotted path to a user's
            ``async generate(ctx, sample) -> sample``.
        agent: for ``"multi_turn"``: the dotted path of ``async agent(base_url, sample,
            request) -> dict | None``.

    Raises:
        ValueError: an unknown name, a missing or unexpected ``agent``, or a dotted path to
            something that is not an async function.
    """
    from miles_rollout.generate.multi_turn import MultiTurnGenerate
    from miles_rollout.generate.single_turn import single_turn_generate

    if name == "multi_turn":
        if not agent:
            raise ValueError(
                "generate function 'multi_turn' needs an agent: a dotted path to "
                "async agent(base_url, sample, request)"
            )
        return MultiTurnGenerate(agent)
    if agent:
        raise ValueError(f"an agent is only used with generate function 'multi_turn', not {name!r}")
    if name in (None, "single_turn"):
        return single_turn_generate
    fn = load_callable(name)
    if not is_async_callable(fn):
        raise ValueError(
            f"generate function {name!r} must be an async function generate(ctx, sample) -> "
            "sample (or an object with an async __call__)"
        )
    return fn
