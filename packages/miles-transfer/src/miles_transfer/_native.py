"""The optional native extension ``miles_transfer._ext``, loaded once for every user.

Built from ``native/transfer`` when a C++ compiler exists at install time (re-sharding copies,
disk-delta kernels). Without it, or with ``MILES_TRANSFER_DISABLE_NATIVE=1``, ``ext`` is None,
``error`` says why, and callers use their PyTorch reference paths (same bytes, slower).
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

__all__ = ["error", "ext"]

ext: ModuleType | None
error: str | None
try:
    if os.environ.get("MILES_TRANSFER_DISABLE_NATIVE", "") == "1":
        raise ImportError("disabled by MILES_TRANSFER_DISABLE_NATIVE=1")
    if importlib.util.find_spec("miles_transfer._ext") is None:
        raise ImportError("not built (no C++ compiler when miles-transfer was installed)")
    from miles_transfer import _ext as ext  # type: ignore[attr-defined,no-redef]

    error = None
except ImportError as exc:  # not built (no compiler at install), or another Python / platform
    ext = None
    error = f"{type(exc).__name__}: {exc}"
