"""Sandbox backends: local (bubblewrap), podman, and adapters over cloud SDKs.

Each backend module has ``available() -> (ok, why not)``, cheap and without importing its
SDK, and a `Sandbox` subclass with ``async create(spec, **options)``.
"""

from __future__ import annotations

import importlib

__all__ = ["availability"]


def availability(backend: str) -> tuple[bool, str]:
    """Whether ``backend`` can create sandboxes here, and if not, why (what to install or
    which key to set)."""
    from miles_env.sandbox import BACKENDS

    target = BACKENDS.get(backend)
    if target is None:
        return False, f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}"
    module = importlib.import_module(target.split(":")[0])
    ok, why = module.available()
    return bool(ok), str(why)
