"""Miles: RL post-training for LLMs. The ``miles`` CLI and the loop that joins the packages."""

from miles.config import RunConfig, load_recipe
from miles.loop import RunResult, train
from miles.version import __version__

__all__ = ["RunConfig", "RunResult", "__version__", "load_recipe", "train"]
