"""Build typed config dataclasses from plain dicts (YAML), with errors that name the key."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

__all__ = ["build_dataclass", "to_plain"]

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; convert lists to tuples and ints to floats."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        errors: dict[Any, ValueError] = {}
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ValueError as e:
                errors[arg] = e
        # A mapping meant for an optional nested config: its own error names the bad key.
        for arg, err in errors.items():
            if isinstance(value, dict) and dataclasses.is_dataclass(arg):
                raise err
        names = " or ".join(_type_name(a) for a in typing.get_args(tp))
        raise ValueError(f"{where}: {value!r} is not a valid {names}")
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(f"{where}: expected null, got {value!r}")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return build_dataclass(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ValueError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(
                _coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))
            )
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-4" (no dot) as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ValueError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return value


def build_dataclass(cls: type[T], data: dict[str, Any], where: str, **fixed: Any) -> T:
    """Instantiate dataclass ``cls`` from ``data``.

    Args:
        cls: the config dataclass.
        data: user-supplied values (from YAML or a Python recipe).
        where: dotted location used in error messages (``"trainer.loss"``).
        **fixed: values set by the caller, which the user may not set in ``data``.

    Raises:
        ValueError: an unknown key (the message lists the valid ones), a value of the wrong
            type, or the dataclass's own validation failing.
    """
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    settable = [n for n in names if n not in fixed]
    unknown = sorted(set(data) - set(settable))
    if unknown:
        taken = [k for k in unknown if k in fixed]
        if taken:
            raise ValueError(
                f"recipe key {where}.{taken[0]} cannot be set here: it is set once at the top "
                f"level of the recipe"
            )
        raise ValueError(
            f"unknown recipe key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'{where}.{k}' for k in unknown)}; valid keys in '{where}': "
            f"{', '.join(settable)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs, **fixed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"recipe section '{where}': {e}") from e


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for writing the resolved config)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_plain(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.init and not f.name.startswith("_")
        }
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
