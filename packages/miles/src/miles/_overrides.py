"""``--set section.key=value`` overrides, parsed without importing the components (so that a
typo is reported at once, before torch loads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

__all__ = ["parse_overrides"]


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """``["trainer.lr=1e-4", ...]`` -> ``[("trainer.lr", 1e-4), ...]``; values are YAML.

    Raises:
        ValueError: an item without ``=`` or a key, or a value that is not valid YAML (the
            message names the override and how to write it).
    """
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} must look like section.key=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            where = str(e).splitlines()[0]
            raise ValueError(
                f"override {item!r}: the value {raw!r} is not valid YAML ({where}); quote a "
                f"string (--set '{key.strip()}=\"...\"') or give a number, true/false or [a, b]"
            ) from None
        out.append((key.strip(), value))
    return out
