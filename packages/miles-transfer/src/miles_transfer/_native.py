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
    from miles_transfer import _ext as ext  # type: ignore[attr-defined,no-redef,unused-ignore]

    error = None
except ImportError as exc:  # not built (no compiler at install), or another Python / platform
    ext = None
    error = f"{type(exc).__name__}: {exc}"

# CI (make test) sets MILES_REQUIRE_NATIVE=1: an extension that failed to build is an error there,
# not a quiet fallback that turns the native tests into skips. Disabling it on purpose still works.
if (
    ext is None
    and os.environ.get("MILES_REQUIRE_NATIVE", "") == "1"
    and os.environ.get("MILES_TRANSFER_DISABLE_NATIVE", "") != "1"
):
    raise ImportError(
        f"MILES_REQUIRE_NATIVE=1 but miles-transfer's native extension "
        "(the re-sharding and delta kernels) "
        f"did not load: {error}. Rebuild it with a C++ compiler present "
        "(pip install --no-deps -e packages/miles-transfer), "
        "or unset MILES_REQUIRE_NATIVE to run on the PyTorch fallback"
    )
