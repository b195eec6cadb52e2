"""Built-in verifiable tasks: prompt generators paired with rule-based rewards.

- :class:`ArithmeticTask`: single-turn integer arithmetic.
- :class:`GuessNumberTask` with its agent ``guess_number.play``: multi-turn, through a TITO
  session (``MultiTurnGenerate("miles_rollout.tasks.guess_number:play")``).
- :class:`WordProblemTask`: seeded multi-step arithmetic word problems (for small LMs).
- :class:`DatasetTask`: prompts and labels from JSONL / JSON / Parquet / ``datasets`` dirs.
"""

from miles_rollout.tasks.arithmetic import ArithmeticTask
from miles_rollout.tasks.dataset import DatasetTask
from miles_rollout.tasks.guess_number import GuessNumberTask
from miles_rollout.tasks.word_problems import WordProblemTask
from miles_rollout.types import PromptItem

__all__ = ["ArithmeticTask", "DatasetTask", "GuessNumberTask", "PromptItem", "WordProblemTask"]
