"""Reward functions a recipe names by dotted path (``task.reward_fn``), and their timeout.

    task:
      name: dataset
      params: {path: data/math.jsonl, template: "{problem}", label_field: answer}
      reward_fn: miles.rewards:math_equivalence     # or exact_match, code_tests
      reward_timeout_s: 30                           # a hung reward fails its sample

Each takes the finished ``Sample`` (``response``, ``label``) and returns a float in [0, 1];
what it found goes to ``sample.metadata["reward_info"]``. ``code_tests`` is async and runs the
response against the label's tests in a miles-env sandbox (``pip install 'miles[env]'``).
A reward function that raises or outlives ``task.reward_timeout_s`` fails its sample with the
reason in ``sample.metadata["error"]`` (its group is dropped, ``rollout.max_drop_frac`` bounds
how many), never a silent zero.
"""

from miles.rewards.code_tests import code_tests, extract_code
from miles.rewards.match import exact_match
from miles.rewards.math_answer import extract_answer, math_equal, math_equivalence
from miles.rewards.timeout import RewardTimeoutError, with_timeout

__all__ = [
    "RewardTimeoutError",
    "code_tests",
    "exact_match",
    "extract_answer",
    "extract_code",
    "math_equal",
    "math_equivalence",
    "with_timeout",
]
