"""Resolve a user function named by dotted path (``"package.module:function"``)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["is_dotted_path", "resolve_function"]


def is_dotted_path(name: str) -> bool:
    """True for ``"package.module:function"`` (what recipes use for user hooks)."""
    return ":" in name


@functools.cache
def resolve_function(path: str, key: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` and return the callable.

    Args:
        path: ``"package.module:function"`` (``"package.module:Class.method"`` also works).
        key: the recipe key that named it, for the error message.

    Raises:
        ValueError: malformed path, a module that does not import, a missing attribute, or an
            object that is not callable (the message names ``key``).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f'{key} = {path!r}: a user function is written "package.module:function"')
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key} = {path!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key} = {path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key} = {path!r}: {attr!r} is not callable")
    return obj
