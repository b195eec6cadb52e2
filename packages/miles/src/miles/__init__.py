"""Miles: RL post-training for LLMs. The ``miles`` CLI and the loop that joins the packages.

``import miles`` works with the meta-package alone; the names below import the components
(``pip install 'miles[all]'``) on first use and say what to install when one is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from miles.version import __version__

if TYPE_CHECKING:
    from miles.config import RunConfig, load_recipe
    from miles.evaluation import SkipEval
    from miles.loop import RunResult, train

__all__ = ["RunConfig", "RunResult", "SkipEval", "__version__", "load_recipe", "train"]

_LAZY = {
    "RunConfig": "miles.config",
    "load_recipe": "miles.config",
    "RunResult": "miles.loop",
    "train": "miles.loop",
    "SkipEval": "miles.evaluation",
}


def require_components(what: str = "this") -> None:
    """Raise an ImportError naming ``pip install 'miles[all]'`` when a component is missing."""
    for module, extra in (
        ("miles_rollout", "rollout"),
        ("miles_trainer", "trainer"),
        ("miles_transfer", "transfer"),
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ImportError(
                f"{what} needs the Miles components, and {module} is not installed: "
                f"pip install 'miles[all]' (or 'miles[{extra}]')"
            ) from e


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'miles' has no attribute {name!r}")
    require_components(f"miles.{name}")
    return getattr(importlib.import_module(module), name)
