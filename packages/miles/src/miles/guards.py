"""Checks that stop (or warn about) a run that cannot learn, with the reason and likely causes."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["NO_SIGNAL_FRAC", "RunStoppedError", "StepGuard"]

logger = logging.getLogger("miles")

NO_SIGNAL_FRAC = 0.9
"""A step "has no learning signal" when at least this share of its groups has one reward."""


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
    """

    def __init__(self, *, max_drop_frac: float, no_signal_steps: int, no_signal_action: str):
        self.max_drop_frac = max_drop_frac
        self.no_signal_steps = no_signal_steps
        self.no_signal_action = no_signal_action
        self.streak = 0

    def check(
        self,
        step: int,
        n_groups: int,
        batch: Any,
        stats: dict[str, float],
        *,
        reward_mean: float | None = None,
    ) -> None:
        """Raise ``RunStoppedError`` or log a warning; adds ``no_signal_streak`` to ``stats``.

        Raises:
            RunStoppedError: nothing to train on, too many dropped groups, or no learning signal
                for ``no_signal_steps`` steps with ``no_signal_action: stop``.
        """
        dropped = float(stats.get("groups_dropped", 0.0))
        if batch is None:
            raise RunStoppedError(
                f"step {step}: nothing to train on: all {n_groups} groups were dropped (aborted "
                "or failed samples; see the log for the engine errors). Check that the engines "
                "are up (rollout.engine_url) and that the reward function does not raise"
            )
        if n_groups and dropped / n_groups > self.max_drop_frac:
            raise RunStoppedError(
                f"step {step}: {dropped:.0f} of {n_groups} groups were dropped (aborted or "
                f"failed samples), above rollout.max_drop_frac={self.max_drop_frac}; see the log "
                "for the engine or reward errors"
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
