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

# CI (make test) sets MILES_REQUIRE_NATIVE=1: an extension that failed to build is an error there,
# not a quiet fallback that turns the native tests into skips. Disabling it on purpose still works.
if (
    ext is None
    and os.environ.get("MILES_REQUIRE_NATIVE", "") == "1"
    and os.environ.get("MILES_ROLLOUT_DISABLE_NATIVE", "") != "1"
):
    raise ImportError(
        f"MILES_REQUIRE_NATIVE=1 but miles-rollout's native extension "
        "(the decode-attention kernel) "
        f"did not load: {error}. Rebuild it with a C++ compiler present "
        "(pip install --no-deps -e packages/miles-rollout), "
        "or unset MILES_REQUIRE_NATIVE to run on the PyTorch fallback"
    )
