"""Built-in verifiable tasks: prompt generators paired with rule-based rewards.

- :class:`ArithmeticTask`: single-turn integer arithmetic.
- :class:`GuessNumberTask` with its agent ``guess_number.play``: multi-turn, through a TITO
  session (``MultiTurnGenerate("miles_rollout.tasks.guess_number:play")``).
"""

from miles_rollout.tasks.arithmetic import ArithmeticTask
from miles_rollout.tasks.guess_number import GuessNumberTask
from miles_rollout.types import PromptItem

__all__ = ["ArithmeticTask", "GuessNumberTask", "PromptItem"]
