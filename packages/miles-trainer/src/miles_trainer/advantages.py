"""Advantage estimators: plain functions from per-sample rewards to per-sample advantages.

The trainer consumes per-token advantages; an outcome-reward estimator gives every response
token of a sample the same value (``[a] * response_length``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["grpo_advantages", "reinforce_pp_advantages"]


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and unbiased (n - 1) standard deviation.

    Equal values (including a single value) give exactly ``(x0, 0.0)``, so that ``x - mean`` is
    exactly 0 rather than a rounding residue that a tiny std would blow up.
    """
    n = len(xs)
    if max(xs) == min(xs):
        return float(xs[0]), 0.0
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var)


def _check_rewards(rewards: Sequence[float]) -> None:
    if len(rewards) == 0:
        raise ValueError("rewards is empty")
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"rewards[{i}] is {r}; every reward must be finite")


def grpo_advantages(
    rewards: Sequence[float], group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO group-normalised advantages.

    The samples of one group (the responses to one prompt) are contiguous: group ``g`` is
    ``rewards[g * group_size : (g + 1) * group_size]``. For sample ``i`` in group ``g``::

        A_i = (r_i - mean_g) / (std_g + eps)    if normalize_std
        A_i =  r_i - mean_g                     otherwise

    where ``std_g`` is the unbiased (n - 1) standard deviation of the group, as ``torch.std``
    computes it. A group whose rewards are all equal has ``A_i = 0`` for every sample (no
    learning signal); a group of one sample likewise.

    Args:
        rewards: one scalar reward per sample, groups contiguous.
        group_size: samples per group (>= 1); must divide ``len(rewards)``.
        normalize_std: divide by the group standard deviation (GRPO) or not (Dr. GRPO).
        eps: added to the standard deviation; >= 0.

    Returns:
        One advantage per sample, in the input order.

    Raises:
        ValueError: empty or non-finite rewards, a bad group size, or a negative eps.
    """
    _check_rewards(rewards)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if len(rewards) % group_size != 0:
        raise ValueError(
            f"len(rewards) = {len(rewards)} is not a multiple of group_size = {group_size}; "
            "each group must hold exactly group_size contiguous samples"
        )
    if eps < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean, std = _mean_std(group)
        for r in group:
            centred = r - mean
            if not normalize_std or std == 0.0:
                out.append(centred)  # a zero-variance group has centred == 0 exactly
            else:
                out.append(centred / (std + eps))
    return out


def reinforce_pp_advantages(
    rewards: Sequence[float], group_size: int = 1, *, eps: float = 1e-6
) -> list[float]:
    """REINFORCE++ advantages: optional group baseline, then batch normalisation.

    With ``group_size == 1`` (REINFORCE++)::

        x_i = r_i

    with ``group_size > 1`` (REINFORCE++-baseline; groups contiguous as in GRPO)::

        x_i = r_i - mean_g

    then over the whole batch::

        A_i = (x_i - mean(x)) / (std(x) + eps)

    with ``std`` the unbiased (n - 1) standard deviation of the batch. A batch whose ``x`` are
    all equal gives all-zero advantages.

    Args:
        rewards: one scalar reward per sample.
        group_size: samples per group for the baseline; 1 means no group baseline.
        eps: added to the batch standard deviation; >= 0.

    Returns:
        One advantage per sample, in the input order.

    Raises:
        ValueError: empty or non-finite rewards, a bad group size, or a negative eps.
    """
    centred = grpo_advantages(rewards, group_size, normalize_std=False, eps=eps)
    xs = list(rewards) if group_size == 1 else centred
    mean, std = _mean_std(xs)
    out: list[float] = []
    for x in xs:
        c = x - mean
        out.append(c if std == 0.0 else c / (std + eps))
    return out
