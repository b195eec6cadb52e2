"""Checks that stop (or warn about) a run that cannot learn, with the reason and likely causes."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["NO_SIGNAL_FRAC", "RunStoppedError", "StepGuard"]

logger = logging.getLogger("miles")

NO_SIGNAL_FRAC = 0.9
"""A step "has no learning signal" when at least this share of its groups has one reward."""


_ENGINE_CAUSE = (
    " (aborted or failed generations; see the log for the engine errors). Check that the "
    "engines are up (rollout.engine_url) and that the reward function does not raise"
)


_FUNCTION = re.compile(r"reward function (\S+) ")
_TIMEOUT_MARK = "raised RewardTimeoutError("  # miles.rewards.timeout's deadline, as grade logs it


class RunStoppedError(RuntimeError):
    """The run stopped on purpose; the message says why and what to check."""


class StepGuard:
    """Judges each step's batch before training (rank 0).

    Args:
        max_drop_frac: stop when more than this share of a step's groups was dropped (an
            aborted or failed sample, e.g. engine errors).
        no_signal_steps: after this many steps in a row where at least ``NO_SIGNAL_FRAC`` of
            the groups have zero reward variance (nothing to learn from), warn or stop; 0
            disables the check.
        no_signal_action: ``"warn"`` or ``"stop"``.
        reward_timeout_s: the run's ``task.reward_timeout_s``, named in the fix when the drops
            are reward failures.
    """

    def __init__(
        self,
        *,
        max_drop_frac: float,
        no_signal_steps: int,
        no_signal_action: str,
        reward_timeout_s: float | None = None,
    ):
        self.max_drop_frac = max_drop_frac
        self.no_signal_steps = no_signal_steps
        self.no_signal_action = no_signal_action
        self.reward_timeout_s = reward_timeout_s
        self.streak = 0

    def check(
        self,
        step: int,
        n_groups: int,
        batch: Any,
        stats: dict[str, float],
        *,
        reward_mean: float | None = None,
        groups: Sequence[Sequence[Any]] = (),
    ) -> None:
        """Raise ``RunStoppedError`` or log a warning; adds ``no_signal_streak`` to ``stats``.

        ``groups`` (the step's samples, optional) lets a stop name the reward function first
        when groups were dropped because their rewards failed (``task.reward_errors: drop``).

        Raises:
            RunStoppedError: nothing to train on, too many dropped groups, or no learning signal
                for ``no_signal_steps`` steps with ``no_signal_action: stop``.
        """
        dropped = float(stats.get("groups_dropped", 0.0))
        if batch is None:
            raise RunStoppedError(
                f"step {step}: nothing to train on: all {n_groups} groups were dropped"
                + (self._reward_cause(groups, dropped) or _ENGINE_CAUSE)
            )
        if n_groups and dropped / n_groups > self.max_drop_frac:
            raise RunStoppedError(
                f"step {step}: {dropped:.0f} of {n_groups} groups were dropped, above "
                f"rollout.max_drop_frac={self.max_drop_frac}"
                + (self._reward_cause(groups, dropped) or _ENGINE_CAUSE)
            )
        zero = float(stats.get("zero_std_groups_frac", 0.0))
        self.streak = self.streak + 1 if zero >= NO_SIGNAL_FRAC else 0
        stats["no_signal_streak"] = float(self.streak)
        if self.no_signal_steps and self.streak >= self.no_signal_steps:
            reward = reward_mean
            message = (
                f"step {step}: for {self.streak} steps in a row at least {NO_SIGNAL_FRAC:.0%} of "
                f"the groups had the same reward for every sample (reward mean {reward}), so "
                "their advantages are zero and nothing is learned. Likely causes: the task is "
                "too hard (reward always 0: check the reward function on a few responses, "
                "sampling.max_new_tokens, the prompt template) or too easy (always 1); "
                "sampling.temperature too low for samples to differ; "
                "rollout.n_samples_per_prompt too small"
            )
            if self.no_signal_action == "stop":
                raise RunStoppedError(message + " (run.no_signal_action: stop)")
            if self.streak == self.no_signal_steps:  # once per streak
                logger.warning(message)

    def _reward_cause(self, groups: Sequence[Sequence[Any]], dropped: float) -> str | None:
        """Why the groups were dropped when reward failures dropped any of them, else None.

        A sample whose reward failed under ``reward_errors: drop`` has no reward and its
        ``reward_error`` says why (``miles_rollout.reward.grade``: ``reward function NAME ...``).
        """
        failures = [
            s.metadata["reward_error"]
            for g in groups
            for s in g
            if s.reward is None and "reward_error" in s.metadata
        ]
        if not failures:
            return None
        by_reward = sum(
            any(s.reward is None and "reward_error" in s.metadata for s in g) for g in groups
        )
        n_samples = sum(len(g) for g in groups)
        names = sorted({m.group(1) for f in failures if (m := _FUNCTION.match(f))})
        fn = f"the reward function {', '.join(names)}" if names else "the reward function"
        timed_out = sum(_TIMEOUT_MARK in f for f in failures)
        raised = len(failures) - timed_out
        if timed_out:
            limit = f"={self.reward_timeout_s:g} s" if self.reward_timeout_s else ""
            what = f"{fn} timed out (task.reward_timeout_s{limit}) on {timed_out}"
            what += f" and failed on {raised}" if raised else ""
            fix = (
                "raise task.reward_timeout_s if the function is slow but right, fix the function "
                "if it hangs"
            )
        else:
            what = f"{fn} failed on {raised}"
            fix = "fix the function"
        first = failures[0] if len(failures[0]) <= 400 else failures[0][:397] + "..."
        others = dropped - by_reward
        rest = (
            f"; {others:.0f} other group(s) had aborted or failed generations (check the "
            "engines: rollout.engine_url)"
            if others > 0
            else ""
        )
        return (
            f": {what} of the step's {n_samples} samples, so their {by_reward} group(s) were "
            f"dropped (task.reward_errors: drop){rest}. First failure: {first}. Fix: {fix}, or "
            "set task.reward_errors: zero (a failed reward scores 0 and the run trains on) or "
            "fail (the first failure stops the run with its traceback)"
        )
