"""The optional native extension ``miles_rollout._ext``, loaded once for every user.

Built from ``native/rollout`` when a C++ compiler exists at install time (the bf16
decode-attention kernel). Without it, or with ``MILES_ROLLOUT_DISABLE_NATIVE=1``, ``ext`` is
None, ``error`` says why, and the engine uses its PyTorch attention (same maths, slower).
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

__all__ = ["error", "ext"]

ext: ModuleType | None
error: str | None
try:
    if os.environ.get("MILES_ROLLOUT_DISABLE_NATIVE", "") == "1":
        raise ImportError("disabled by MILES_ROLLOUT_DISABLE_NATIVE=1")
    if importlib.util.find_spec("miles_rollout._ext") is None:
        raise ImportError("not built (no C++ compiler when miles-rollout was installed)")
    from miles_rollout import _ext as ext  # type: ignore[attr-defined,no-redef]

    error = None
except ImportError as exc:  # not built (no compiler at install), or another Python / platform
    ext = None
    error = f"{type(exc).__name__}: {exc}"
