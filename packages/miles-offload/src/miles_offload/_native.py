"""Loader of the native extension (C++ in native/offload/, bound with nanobind).

Importing this module never fails. Without miles_offload._ext (not built, built for another
Python, or disabled with MILES_OFFLOAD_DISABLE_NATIVE=1) `available()` is False, `error()` says
why, and the package runs its pure-Python pager (os.preadv/os.pwritev on a thread pool) and a
pure-Python CRC-32C: same files and bits, much slower. The first use warns once.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

_ext: ModuleType | None
_error: str | None
try:
    if os.environ.get("MILES_OFFLOAD_DISABLE_NATIVE", "") == "1":
        raise ImportError("disabled by MILES_OFFLOAD_DISABLE_NATIVE=1")
    from miles_offload import _ext  # type: ignore[attr-defined,no-redef]

    _error = None
except ImportError as exc:  # not built, or built for another Python / platform
    _ext = None
    _error = f"{type(exc).__name__}: {exc}"

# CI (make test) sets MILES_REQUIRE_NATIVE=1: an extension that failed to build is an error there,
# not a quiet fallback that turns the native tests into skips. Disabling it on purpose still works.
if (
    _ext is None
    and os.environ.get("MILES_REQUIRE_NATIVE", "") == "1"
    and os.environ.get("MILES_OFFLOAD_DISABLE_NATIVE", "") != "1"
):
    raise ImportError(
        f"MILES_REQUIRE_NATIVE=1 but miles-offload's native extension (the pager and CRC-32C) "
        f"did not load: {_error}. Rebuild it with a C++ compiler present "
        "(pip install --no-deps -e packages/miles-offload), "
        "or unset MILES_REQUIRE_NATIVE to run on the PyTorch fallback"
    )

_warned: set[str] = set()


def available() -> bool:
    """Whether the native pager and checksum can run in this process."""
    return _ext is not None


def error() -> str | None:
    """Why the native extension is unavailable (None when it is available)."""
    return _error


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
