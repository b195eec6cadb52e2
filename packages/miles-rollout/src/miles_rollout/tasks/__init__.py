"""Built-in verifiable tasks: prompt generators paired with rule-based rewards."""

from miles_rollout.tasks.arithmetic import ArithmeticTask, PromptItem

__all__ = ["ArithmeticTask", "PromptItem"]
