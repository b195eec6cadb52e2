"""Ray is an optional extra: imported only where ``--ray`` needs it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

__all__ = ["import_ray", "passthrough_env"]

# What a trainer rank or an engine gets from the launching shell on any node (on this machine
# a local Ray's processes inherit everything anyway).
_PASSTHROUGH = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONPATH")
_PASSTHROUGH_PREFIXES = ("MILES_", "NCCL_", "GLOO_", "HF_", "TRANSFORMERS_")


def import_ray() -> ModuleType:
    """``import ray``, or an ImportError that names the install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "miles train --ray needs Ray: pip install 'miles[ray]' (or pip install ray)"
        ) from e
    return ray


def passthrough_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The variables every actor sets before it imports anything heavy, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k in _PASSTHROUGH or k.startswith(_PASSTHROUGH_PREFIXES)
    }
    env.update(extra)
    return env
