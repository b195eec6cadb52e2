"""Advantage estimators and the reward shaping before them, selected by `AdvantageConfig`.

The trainer computes advantages (the loop hands it rewards and group ids in the `TrainBatch`):
first the reward shaping (DAPO's overlong penalty), then the group filter (DAPO's dynamic
sampling), then the estimator, optionally whitened. Outcome estimators give one value per sample,
repeated over its response tokens; GAE gives one per token from the critic's values.

The list functions (`grpo_advantages`, `rloo_advantages`, ...) are plain and public: a loop that
wants to compute advantages itself can call them and pass ``TrainBatch.advantages``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_trainer._dotted import is_dotted_path, resolve_function
from miles_trainer.batch import TrainBatch

__all__ = [
    "ESTIMATORS",
    "GROUP_FILTERS",
    "AdvantageConfig",
    "AdvantageContext",
    "GroupView",
    "OverlongConfig",
    "batch_advantages",
    "gae_advantages",
    "group_indices",
    "grpo_advantages",
    "nonzero_std",
    "overlong_penalty",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "shape_and_filter",
]

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
GROUP_FILTERS = ("nonzero_std",)


# ---------------------------------------------------------------------------------- configs


@dataclass(kw_only=True, slots=True)
class OverlongConfig:
    """DAPO's soft overlong punishment, added to the reward (``advantage.overlong``).

    With ``L`` a sample's response length, ``L_max = max_length``, ``B = buffer_length``::

        penalty = 0                              L <= L_max - B
        penalty = (L_max - B - L) / B            L_max - B < L <= L_max   (0 down to -1)
        penalty = -1                             L > L_max
        reward += penalty_factor * penalty

    Attributes:
        max_length: the generation budget ``L_max`` in tokens. >= 1.
        buffer_length: the soft zone ``B`` before it. In [1, max_length].
        penalty_factor: scale of the penalty. >= 0.
    """

    max_length: int
    buffer_length: int
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError(f"OverlongConfig.max_length must be >= 1, got {self.max_length}")
        if not 1 <= self.buffer_length <= self.max_length:
            raise ValueError(
                f"OverlongConfig.buffer_length must be in [1, max_length = {self.max_length}], "
                f"got {self.buffer_length}"
            )
        if not (self.penalty_factor >= 0 and math.isfinite(self.penalty_factor)):
            raise ValueError(
                f"OverlongConfig.penalty_factor must be finite and >= 0, got {self.penalty_factor}"
            )

    def build(self) -> Callable[[int], float]:
        """``length -> penalty_factor * penalty`` (the amount added to the reward)."""
        return lambda length: (
            self.penalty_factor * overlong_penalty(length, self.max_length, self.buffer_length)
        )


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """How the trainer turns rewards into advantages (``trainer.advantage`` in a recipe).

    Attributes:
        estimator: "grpo" (group mean and std), "dr_grpo" (group mean only), "rloo"
            (leave-one-out mean), "reinforce_pp" (batch-normalised reward),
            "reinforce_pp_baseline" (group mean, then batch-normalised), "gae" (per token from
            the critic's values; needs ``TrainerConfig.critic``), or a user function
            ``"package.module:function"`` taking an `AdvantageContext` and returning one value
            per sample or one list per sample (per response token).
        eps: added to standard deviations before dividing. >= 0.
        gamma: GAE discount. In [0, 1].
        lam: GAE lambda. In [0, 1].
        whiten: after the estimator, normalise the advantages over the loss tokens of the
            batch to mean 0 and standard deviation 1 (the usual PPO practice with GAE).
        group_filter: which groups to train on: None (all), "nonzero_std" (DAPO dynamic
            sampling: drop groups whose rewards are all equal, they carry no group-relative
            signal), or a user function ``"package.module:function"`` taking a `GroupView` and
            returning True to keep the group.
        overlong: DAPO's overlong reward penalty; None disables it.
        params: keyword values for a user estimator (``AdvantageContext.params``).
    """

    estimator: str = "grpo"
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = False
    group_filter: str | None = None
    overlong: OverlongConfig | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS and not is_dotted_path(self.estimator):
            raise ValueError(
                f"AdvantageConfig.estimator must be one of {ESTIMATORS} or a user function "
                f'"package.module:function", got {self.estimator!r}'
            )
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"AdvantageConfig.eps must be finite and >= 0, got {self.eps}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"AdvantageConfig.{name} must be in [0, 1], got {getattr(self, name)}"
                )
        gf = self.group_filter
        if gf is not None and gf not in GROUP_FILTERS and not is_dotted_path(gf):
            raise ValueError(
                f"AdvantageConfig.group_filter must be None, one of {GROUP_FILTERS} or a user "
                f'function "package.module:function", got {gf!r}'
            )

    @property
    def needs_values(self) -> bool:
        """Whether the estimator needs the critic's values (GAE)."""
        return self.estimator == "gae"

    def build(self) -> Callable[[AdvantageContext], list[list[float]]]:
        """The estimator as ``ctx -> per-token advantages`` (user functions imported now).

        Raises:
            ValueError: a user function that does not import (the message names the key).
        """
        user = None
        if is_dotted_path(self.estimator):
            user = resolve_function(self.estimator, "trainer.advantage.estimator")
        if self.group_filter is not None and is_dotted_path(self.group_filter):
            resolve_function(self.group_filter, "trainer.advantage.group_filter")

        def estimate(ctx: AdvantageContext) -> list[list[float]]:
            if user is not None:
                out = _per_token(user(ctx), ctx, self.estimator)
            else:
                out = _builtin(self, ctx)
            return _whiten(out, ctx.loss_masks, self.eps) if self.whiten else out

        return estimate

    def keep_group(self, group: GroupView) -> bool:
        """Whether ``group`` is trained on (per ``group_filter``)."""
        if self.group_filter is None:
            return True
        if self.group_filter == "nonzero_std":
            return nonzero_std(group)
        fn = resolve_function(self.group_filter, "trainer.advantage.group_filter")
        keep = fn(group)
        if not isinstance(keep, bool):
            raise TypeError(
                f"trainer.advantage.group_filter {self.group_filter!r} returned "
                f"{type(keep).__name__}; it must return True (keep) or False (drop)"
            )
        return keep


# ---------------------------------------------------------------------------------- contexts


@dataclass(frozen=True, slots=True)
class GroupView:
    """What a group filter sees: one group (the samples of one prompt).

    Attributes:
        group_id: the samples' ``TrainBatch.group_ids`` value.
        rewards: their rewards (after the overlong penalty), in batch order.
        response_lengths: their response lengths.
    """

    group_id: int
    rewards: tuple[float, ...]
    response_lengths: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdvantageContext:
    """What an advantage estimator sees (never the whole config).

    Attributes:
        rewards: one scalar per sample (after the overlong penalty).
        group_ids: one group id per sample; samples of one prompt share it.
        response_lengths: response tokens per sample.
        loss_masks: per sample, 1 on response tokens that are trained on.
        values: the critic's value per response token (before the update), or None without a
            critic.
        params: ``AdvantageConfig.params``.
    """

    rewards: tuple[float, ...]
    group_ids: tuple[int, ...]
    response_lengths: tuple[int, ...]
    loss_masks: tuple[tuple[int, ...], ...]
    values: tuple[tuple[float, ...], ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- helpers


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


def group_indices(
    n: int, group_size: int | None = None, group_ids: Sequence[int] | None = None
) -> list[list[int]]:
    """Sample indices of each group, groups in order of first appearance.

    Give exactly one of ``group_size`` (groups are contiguous runs of that many samples) and
    ``group_ids`` (one id per sample; a group's samples need not be contiguous).

    Raises:
        ValueError: both or neither given, a bad group size, or a length mismatch.
    """
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size and group_ids")
    if group_size is not None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if n % group_size != 0:
            raise ValueError(
                f"len(rewards) = {n} is not a multiple of group_size = {group_size}; "
                "each group must hold exactly group_size contiguous samples"
            )
        return [list(range(s, s + group_size)) for s in range(0, n, group_size)]
    assert group_ids is not None
    if len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries, rewards has {n}")
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def _check_eps(eps: float) -> None:
    if eps < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")


# ---------------------------------------------------------------------------------- estimators


def grpo_advantages(
    rewards: Sequence[float],
    group_size: int | None = None,
    *,
    group_ids: Sequence[int] | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """GRPO group-normalised advantages (Dr. GRPO with ``normalize_std=False``).

    Groups are contiguous runs of ``group_size`` samples, or the samples sharing a
    ``group_ids`` value. For sample ``i`` in group ``g``::

        A_i = (r_i - mean_g) / (std_g + eps)    if normalize_std     (GRPO)
        A_i =  r_i - mean_g                     otherwise            (Dr. GRPO)

    where ``std_g`` is the unbiased (n - 1) standard deviation of the group, as ``torch.std``
    computes it. A group whose rewards are all equal has ``A_i = 0`` for every sample (no
    learning signal); a group of one sample likewise.

    Args:
        rewards: one scalar reward per sample.
        group_size: samples per group (contiguous); or give ``group_ids``.
        group_ids: one group id per sample.
        normalize_std: divide by the group standard deviation (GRPO) or not (Dr. GRPO).
        eps: added to the standard deviation; >= 0.

    Returns:
        One advantage per sample, in the input order.

    Raises:
        ValueError: empty or non-finite rewards, bad groups, or a negative eps.
    """
    _check_rewards(rewards)
    _check_eps(eps)
    out = [0.0] * len(rewards)
    for idx in group_indices(len(rewards), group_size, group_ids):
        mean, std = _mean_std([rewards[i] for i in idx])
        for i in idx:
            centred = rewards[i] - mean
            # a zero-variance group has centred == 0 exactly
            out[i] = centred if not normalize_std or std == 0.0 else centred / (std + eps)
    return out


def rloo_advantages(
    rewards: Sequence[float],
    group_size: int | None = None,
    *,
    group_ids: Sequence[int] | None = None,
) -> list[float]:
    """RLOO: each sample's baseline is the mean reward of the other samples of its group.

    For sample ``i`` in group ``g`` of ``n >= 2`` samples::

        A_i = r_i - (sum_g r - r_i) / (n - 1)  =  n / (n - 1) * (r_i - mean_g)

    Raises:
        ValueError: empty or non-finite rewards, bad groups, or a group of one sample (it has
            no other samples to form a baseline).
    """
    _check_rewards(rewards)
    out = [0.0] * len(rewards)
    for idx in group_indices(len(rewards), group_size, group_ids):
        n = len(idx)
        if n < 2:
            raise ValueError(
                f"RLOO needs at least 2 samples per group; sample {idx[0]} is alone in its group"
            )
        values = [rewards[i] for i in idx]
        if max(values) == min(values):
            continue  # exactly zero, as in GRPO
        total = sum(values)
        for i in idx:
            out[i] = rewards[i] - (total - rewards[i]) / (n - 1)
    return out


def reinforce_pp_advantages(
    rewards: Sequence[float],
    group_size: int | None = 1,
    *,
    group_ids: Sequence[int] | None = None,
    eps: float = 1e-6,
) -> list[float]:
    """REINFORCE++ advantages: optional group baseline, then batch normalisation.

    Without a baseline (``group_size == 1``, the default)::

        x_i = r_i

    with one (REINFORCE++-baseline: ``group_size > 1`` or ``group_ids``)::

        x_i = r_i - mean_g

    then over the whole batch::

        A_i = (x_i - mean(x)) / (std(x) + eps)

    with ``std`` the unbiased (n - 1) standard deviation of the batch. A batch whose ``x`` are
    all equal gives all-zero advantages.

    Raises:
        ValueError: empty or non-finite rewards, bad groups, or a negative eps.
    """
    _check_rewards(rewards)
    _check_eps(eps)
    if group_ids is not None:
        group_size = None
    if group_size == 1:
        xs = list(rewards)
    else:
        xs = grpo_advantages(rewards, group_size, group_ids=group_ids, normalize_std=False)
    mean, std = _mean_std(xs)
    return [x - mean if std == 0.0 else (x - mean) / (std + eps) for x in xs]


def gae_advantages(
    rewards: Sequence[float],
    values: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[int]],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[list[list[float]], list[list[float]]]:
    """Generalised advantage estimation over each sample's trained tokens.

    The tokens with mask 1 form the trajectory (tokens the policy did not generate, such as
    tool output, are stepped over: they are the environment's move). The outcome reward
    ``r_i`` arrives at the last of them. With ``t`` running over those tokens, ``V`` the
    critic's values and ``V_{T} = 0`` after the last::

        delta_t = [t == T-1] r_i + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                      (the critic's regression target)

    Masked tokens get advantage and return 0.

    Args:
        rewards: one outcome reward per sample.
        values: per sample, the critic's value per response token.
        loss_masks: per sample, the loss mask per response token.
        gamma: discount, in [0, 1].
        lam: GAE lambda, in [0, 1].

    Returns:
        ``(advantages, returns)``, each one list per sample with one value per response token.
    """
    _check_rewards(rewards)
    advs, rets = [], []
    for i, (r, vals, mask) in enumerate(zip(rewards, values, loss_masks, strict=True)):
        if len(vals) != len(mask):
            raise ValueError(f"sample {i}: {len(vals)} values for {len(mask)} response tokens")
        pos = [t for t, m in enumerate(mask) if m]
        adv = [0.0] * len(mask)
        ret = [0.0] * len(mask)
        next_v, next_a = 0.0, 0.0
        for k in range(len(pos) - 1, -1, -1):
            t = pos[k]
            reward = r if k == len(pos) - 1 else 0.0
            delta = reward + gamma * next_v - vals[t]
            next_a = delta + gamma * lam * next_a
            next_v = vals[t]
            adv[t] = next_a
            ret[t] = next_a + vals[t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


# ---------------------------------------------------------------------------------- shaping


def overlong_penalty(length: int, max_length: int, buffer_length: int) -> float:
    """DAPO's soft overlong penalty in [-1, 0] for a response of ``length`` tokens.

    ``0`` up to ``max_length - buffer_length``, then linear down to ``-1`` at ``max_length``,
    ``-1`` beyond it (see `OverlongConfig`).
    """
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer_length
    return -1.0


def nonzero_std(group: GroupView) -> bool:
    """DAPO's dynamic-sampling filter: keep a group only if its rewards are not all equal."""
    return max(group.rewards) != min(group.rewards)


# ---------------------------------------------------------------------------------- dispatch


def _builtin(cfg: AdvantageConfig, ctx: AdvantageContext) -> list[list[float]]:
    rewards, gids = ctx.rewards, ctx.group_ids
    name = cfg.estimator
    if name == "gae":
        if ctx.values is None:
            raise ValueError('advantage.estimator "gae" needs the critic (trainer.critic)')
        adv, _ = gae_advantages(rewards, ctx.values, ctx.loss_masks, gamma=cfg.gamma, lam=cfg.lam)
        return adv
    per_sample: list[float]
    if name in ("grpo", "dr_grpo"):
        per_sample = grpo_advantages(
            rewards, group_ids=gids, normalize_std=name == "grpo", eps=cfg.eps
        )
    elif name == "rloo":
        per_sample = rloo_advantages(rewards, group_ids=gids)
    elif name == "reinforce_pp":
        per_sample = reinforce_pp_advantages(rewards, eps=cfg.eps)
    else:
        assert name == "reinforce_pp_baseline", name
        per_sample = reinforce_pp_advantages(rewards, group_ids=gids, eps=cfg.eps)
    return [[a] * n for a, n in zip(per_sample, ctx.response_lengths)]


def _per_token(out: Any, ctx: AdvantageContext, where: str) -> list[list[float]]:
    """A user estimator's result as per-token lists (per-sample values are repeated)."""
    n = len(ctx.rewards)
    if not isinstance(out, Sequence) or len(out) != n:
        raise ValueError(
            f"advantage estimator {where!r} must return one entry per sample ({n}), got "
            f"{type(out).__name__} of length {len(out) if isinstance(out, Sequence) else '?'}"
        )
    rows: list[list[float]] = []
    for i, (a, r) in enumerate(zip(out, ctx.response_lengths)):
        row = [float(a)] * r if isinstance(a, int | float) else [float(x) for x in a]
        if len(row) != r:
            raise ValueError(
                f"advantage estimator {where!r}: sample {i} has {len(row)} advantages for "
                f"{r} response tokens"
            )
        if not all(map(math.isfinite, row)):
            raise ValueError(f"advantage estimator {where!r}: sample {i} has a non-finite value")
        rows.append(row)
    return rows


def _whiten(
    adv: list[list[float]], masks: Sequence[Sequence[int]], eps: float
) -> list[list[float]]:
    """``(A - mean) / (std + eps)`` over the loss tokens of the batch (masked tokens: 0)."""
    xs = [a for row, mask in zip(adv, masks) for a, m in zip(row, mask) if m]
    if not xs:
        return adv
    mean, std = _mean_std(xs)
    denom = 1.0 if std == 0.0 else std + eps
    return [
        [(a - mean) / denom if m else 0.0 for a, m in zip(row, mask)]
        for row, mask in zip(adv, masks)
    ]


# ---------------------------------------------------------------------------------- batches

_GROUPED = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def shape_and_filter(
    batch: TrainBatch, cfg: AdvantageConfig
) -> tuple[TrainBatch | None, dict[str, float]]:
    """Apply the overlong penalty to the rewards, then the group filter.

    A batch with precomputed ``advantages`` is returned as it is.

    Returns:
        ``(batch, metrics)``: the kept samples in their original order (rewards shaped), or
        None when the filter dropped every group, and
        ``reward_mean`` (before shaping), ``groups``, ``groups_filtered``,
        ``zero_std_groups_frac`` and, with the penalty, ``overlong_penalty_mean``.
    """
    if batch.advantages is not None or batch.rewards is None:
        return batch, {}
    raw = batch.rewards
    n = len(batch)
    metrics = {"reward_mean": sum(raw) / n}
    rewards = list(raw)
    if cfg.overlong is not None:
        penalty = cfg.overlong.build()
        pens = [penalty(r) for r in batch.response_lengths]
        rewards = [r + p for r, p in zip(rewards, pens)]
        metrics["overlong_penalty_mean"] = sum(pens) / n
    gids = batch.group_ids if batch.group_ids is not None else list(range(n))
    groups = group_indices(n, group_ids=gids)
    metrics["groups"] = float(len(groups))
    metrics["zero_std_groups_frac"] = sum(
        1 for idx in groups if len({rewards[i] for i in idx}) == 1
    ) / len(groups)
    kept: list[int] = []
    for idx in groups:
        view = GroupView(
            group_id=gids[idx[0]],
            rewards=tuple(rewards[i] for i in idx),
            response_lengths=tuple(batch.response_lengths[i] for i in idx),
        )
        if cfg.keep_group(view):
            kept.extend(idx)
    metrics["groups_filtered"] = float(len(groups) - len({gids[i] for i in kept}))
    if not kept:
        return None, metrics
    kept.sort()
    out = batch.select(kept)
    out.rewards = [rewards[i] for i in kept]
    return out, metrics


def batch_advantages(
    batch: TrainBatch, cfg: AdvantageConfig, values: Sequence[Sequence[float]] | None = None
) -> tuple[list[list[float]], list[list[float]] | None]:
    """Per-token advantages of ``batch`` (and GAE's returns, the critic's targets).

    Precomputed ``batch.advantages`` are returned as they are. Otherwise the estimator of
    ``cfg`` runs on ``batch.rewards`` (already shaped by `shape_and_filter`), then the optional
    whitening.

    Args:
        batch: the samples.
        cfg: the estimator settings.
        values: the critic's values per response token (GAE), or None.

    Returns:
        ``(advantages, returns or None)``, one list per sample, one value per response token.

    Raises:
        ValueError: an estimator that needs groups on a batch without ``group_ids``, or a user
            estimator returning the wrong shape.
    """
    if batch.advantages is not None:
        return batch.advantages, None
    assert batch.rewards is not None
    if cfg.estimator in _GROUPED and batch.group_ids is None:
        raise ValueError(
            f"advantage.estimator {cfg.estimator!r} compares the samples of a group: the "
            "TrainBatch needs group_ids (one per sample; samples of one prompt share it)"
        )
    n = len(batch)
    ctx = AdvantageContext(
        rewards=tuple(batch.rewards),
        group_ids=tuple(batch.group_ids if batch.group_ids is not None else range(n)),
        response_lengths=tuple(batch.response_lengths),
        loss_masks=tuple(tuple(m) for m in batch.loss_masks),
        values=None if values is None else tuple(tuple(v) for v in values),
        params=cfg.params,
    )
    if cfg.estimator == "gae":
        if values is None:
            raise ValueError('advantage.estimator "gae" needs the critic (trainer.critic)')
        adv, returns = gae_advantages(
            batch.rewards, values, batch.loss_masks, gamma=cfg.gamma, lam=cfg.lam
        )
        return (_whiten(adv, batch.loss_masks, cfg.eps) if cfg.whiten else adv), returns
    return cfg.build()(ctx), None
