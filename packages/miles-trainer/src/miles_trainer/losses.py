"""The RL loss hub: policy losses, KL and entropy terms, train/rollout mismatch corrections.

Backend-agnostic: every function takes ``[B, T]`` tensors (B sequences, T response positions,
right-padded) and a mask that marks the tokens that count. Masked-out positions may hold any
value, even inf or nan: they are replaced with 0 before any arithmetic, so they reach neither
the loss nor the gradient. The FSDP2 and Megatron trainers both call `policy_loss` (and
`value_loss` for PPO's critic) once per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_trainer._dotted import is_dotted_path, resolve_function

__all__ = [
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "LossConfig",
    "LossContext",
    "MismatchConfig",
    "aggregate",
    "kl_estimate",
    "mismatch_weights",
    "policy_loss",
    "value_loss",
]

POLICY_LOSSES = ("ppo", "gspo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
MISMATCH_LEVELS = ("token", "sequence", "geometric")
MISMATCH_MODES = ("truncate", "mask")
# Metrics whose names end in these are reduced by max / min across micro-batches and ranks;
# every other metric is a partial sum.
MAX_SUFFIX, MIN_SUFFIX = "_max", "_min"
# Log-weights are clamped to this range before exp() in the reported statistics only.
_LOG_W_REPORT = 30.0


# ---------------------------------------------------------------------------------- configs


@dataclass(kw_only=True, slots=True)
class MismatchConfig:
    """Importance weights for the rollout/training mismatch (``loss.mismatch``).

    The rollout engine and the trainer compute slightly different probabilities for the same
    tokens (kernels, precision, stale weights in async RL). With ``log w_t = old_logp_t -
    rollout_logp_t`` per loss token, the policy-gradient term of each token is multiplied by a
    detached weight::

        level token:      rho_t = w_t
        level sequence:   rho_i = exp(sum_t log w_t)            (one value per sequence)
        level geometric:  rho_i = exp(mean_t log w_t)
        mode truncate:    weight = min(rho, upper)
        mode mask:        weight = rho if lower <= rho <= upper else 0

    TIS (truncated IS) is level token, mode truncate; MIS is level sequence or geometric with
    either mode; IcePop is level token, mode mask (e.g. lower 0.5, upper 5).

    Attributes:
        level: "token", "sequence" or "geometric".
        mode: "truncate" or "mask".
        upper: the cap (truncate) or the upper bound (mask). > 0.
        lower: the lower bound of mask mode; None means ``1 / upper``. Truncate mode has no
            lower bound. In (0, upper].
    """

    level: str = "token"
    mode: str = "truncate"
    upper: float = 2.0
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.level not in MISMATCH_LEVELS:
            raise ValueError(
                f"MismatchConfig.level must be one of {MISMATCH_LEVELS}, got {self.level!r}"
            )
        if self.mode not in MISMATCH_MODES:
            raise ValueError(
                f"MismatchConfig.mode must be one of {MISMATCH_MODES}, got {self.mode!r}"
            )
        if not (self.upper > 0 and math.isfinite(self.upper)):
            raise ValueError(f"MismatchConfig.upper must be finite and > 0, got {self.upper}")
        if self.lower is not None:
            if self.mode != "mask":
                raise ValueError(
                    "MismatchConfig.lower applies to mode 'mask' only (truncate caps above); "
                    "remove it or set mode: mask"
                )
            if not 0 < self.lower <= self.upper:
                raise ValueError(
                    f"MismatchConfig.lower must be in (0, upper = {self.upper}], got {self.lower}"
                )

    def build(self) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """``(old_logp_BT, rollout_logp_BT, mask_BT) -> (weight_BT, stats)``; see
        `mismatch_weights`."""
        return lambda old, rollout, mask: mismatch_weights(old, rollout, mask, self)


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The RL loss (``trainer.loss`` in a recipe). Formulas: `policy_loss` and the README.

    Attributes:
        name: the policy-gradient term: "ppo" (the clipped token-level ratio of PPO, used by
            GRPO, Dr. GRPO, DAPO, REINFORCE++ and RLOO, which differ in advantages and
            aggregation), "gspo" (the clipped sequence-level ratio), or a user function
            ``"package.module:function"`` taking a `LossContext` and returning the per-token
            loss ``[B, T]`` (or ``(loss_BT, {metric: x_BT})``).
        clip_low: the ratio is clipped below at ``1 - clip_low``. In [0, 1).
        clip_high: the ratio is clipped above at ``1 + clip_high``. Above ``clip_low`` it is
            DAPO's "clip-higher". >= 0.
        dual_clip: PPO dual clip: for negative advantages the token loss is capped at
            ``dual_clip * |A|``. None disables it; > 1.
        kl_coef: weight of the KL(pi || ref) penalty; 0 disables it (and the reference
            model). >= 0.
        kl_type: per-token estimator of KL(pi || ref), with ``d = logp - ref_logp``: "k1" = d,
            "k2" = d^2 / 2, "k3" = exp(-d) - 1 + d, "low_var_kl" = k3 with d clamped to
            [-20, 20] and the result to [-10, 10].
        entropy_coef: weight of the entropy bonus (subtracted from the loss). >= 0.
        loss_agg: how per-token terms become one number (see `aggregate`): "token-mean",
            "seq-mean-token-sum", "seq-mean-token-mean" or "seq-mean-token-sum-norm" (Dr. GRPO:
            token sums divided by a constant length).
        norm_length: the constant length of "seq-mean-token-sum-norm"; None means the longest
            response of the mini-batch. >= 1.
        use_rollout_logprobs: the "old" (behaviour) logprobs of the ratio are the rollout
            engine's; False computes them with the current policy before the update.
        mismatch: importance weights for the rollout/training mismatch (TIS, MIS, IcePop);
            None disables them. Needs ``use_rollout_logprobs`` False.
        params: keyword values for a user loss (``LossContext.params``).
    """

    name: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    norm_length: int | None = None
    use_rollout_logprobs: bool = False
    mismatch: MismatchConfig | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in POLICY_LOSSES and not is_dotted_path(self.name):
            raise ValueError(
                f"LossConfig.name must be one of {POLICY_LOSSES} or a user function "
                f'"package.module:function", got {self.name!r}'
            )
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if not (self.clip_high >= 0.0 and math.isfinite(self.clip_high)):
            raise ValueError(f"LossConfig.clip_high must be finite and >= 0, got {self.clip_high}")
        if self.dual_clip is not None and not (
            self.dual_clip > 1.0 and math.isfinite(self.dual_clip)
        ):
            raise ValueError(f"LossConfig.dual_clip must be None or > 1, got {self.dual_clip}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"LossConfig.kl_coef must be finite and >= 0, got {self.kl_coef}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"LossConfig.kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(
                f"LossConfig.entropy_coef must be finite and >= 0, got {self.entropy_coef}"
            )
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(
                f"LossConfig.loss_agg must be one of {LOSS_AGG_MODES}, got {self.loss_agg!r}"
            )
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"LossConfig.norm_length must be None or >= 1, got {self.norm_length}")
        if self.mismatch is not None and self.use_rollout_logprobs:
            raise ValueError(
                "LossConfig.mismatch needs use_rollout_logprobs: false (with the rollout "
                "logprobs as the old logprobs every importance weight is exactly 1)"
            )

    def build(self) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """`policy_loss` bound to this config (a user loss is imported now).

        Raises:
            ValueError: a user loss that does not import (the message names the key).
        """
        if is_dotted_path(self.name):
            resolve_function(self.name, "trainer.loss.name")

        def loss_fn(
            logp_BT: torch.Tensor,
            old_logp_BT: torch.Tensor,
            advantages_BT: torch.Tensor,
            mask_BT: torch.Tensor,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return policy_loss(logp_BT, old_logp_BT, advantages_BT, mask_BT, self, **kwargs)

        return loss_fn


@dataclass(frozen=True, slots=True)
class LossContext:
    """What a user policy loss sees (never the whole config). All ``[B, T]``; masked
    positions hold 0.

    Attributes:
        logp_BT: current-policy logprobs (carries the gradient).
        old_logp_BT: behaviour logprobs (constant).
        advantages_BT: advantages (constant).
        mask_BT: bool, True on loss tokens.
        rollout_logp_BT: the rollout engine's logprobs (constant), or None.
        entropy_BT: per-token entropy, or None.
        params: ``LossConfig.params``.
    """

    logp_BT: torch.Tensor  # noqa: N815 (tensor names carry their shape)
    old_logp_BT: torch.Tensor  # noqa: N815
    advantages_BT: torch.Tensor  # noqa: N815
    mask_BT: torch.Tensor  # noqa: N815
    rollout_logp_BT: torch.Tensor | None = None  # noqa: N815
    entropy_BT: torch.Tensor | None = None  # noqa: N815
    params: Mapping[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- pieces


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) for tokens sampled from pi.

    With ``d = logp - ref_logp`` (so ``ref / pi = exp(-d)``)::

        k1          = d
        k2          = d^2 / 2
        k3          = exp(-d) - 1 + d               (unbiased, always >= 0)
        low_var_kl  = clamp(k3 of clamp(d, -20, 20), -10, 10)

    Args:
        logp_BT: policy logprobs of the sampled tokens (with grad).
        ref_logp_BT: reference-model logprobs of the same tokens (treated as constants).
        kl_type: one of `KL_TYPES`.

    Returns:
        ``[B, T]`` per-token estimates.
    """
    d_BT = logp_BT - ref_logp_BT.detach()
    if kl_type == "k1":
        return d_BT
    if kl_type == "k2":
        return 0.5 * d_BT.square()
    if kl_type == "k3":
        return torch.exp(-d_BT) - 1.0 + d_BT
    if kl_type == "low_var_kl":
        d_BT = d_BT.clamp(-20.0, 20.0)
        return (torch.exp(-d_BT) - 1.0 + d_BT).clamp(-10.0, 10.0)
    raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def aggregate(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    loss_agg: str,
    *,
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar per ``loss_agg``.

    With ``m`` the mask, ``N_tok`` the number of loss tokens, ``N_seq`` the number of sequences
    of the *global* batch and ``L`` the norm length::

        token-mean:               sum_{i,t} m x / N_tok
        seq-mean-token-sum:       sum_i (sum_t m x) / N_seq
        seq-mean-token-mean:      sum_i (sum_t m x / max(1, sum_t m)) / N_seq
        seq-mean-token-sum-norm:  sum_i (sum_t m x) / (N_seq * L)

    The global counts default to this batch's (``mask.sum()`` floored at 1, ``B``, and ``T``).
    Passing the global counts makes the result a partial sum: summing it over micro-batches and
    ranks gives the value of one big batch.

    Args:
        x_BT: per-token values.
        mask_BT: bool or 0/1 mask, same shape.
        loss_agg: one of `LOSS_AGG_MODES`.
        num_global_tokens: loss tokens in the global batch (token-mean).
        num_global_seqs: sequences in the global batch (the seq-mean modes).
        norm_length: ``L`` of seq-mean-token-sum-norm.

    Returns:
        A 0-dim tensor.
    """
    mask_BT = mask_BT.bool()
    x_BT = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))
    if loss_agg == "token-mean":
        denom = num_global_tokens if num_global_tokens is not None else max(1, int(mask_BT.sum()))
        return x_BT.sum() / denom
    seq_sum_B = x_BT.sum(dim=-1)
    n_seq = num_global_seqs if num_global_seqs is not None else max(1, x_BT.shape[0])
    if loss_agg == "seq-mean-token-sum":
        return seq_sum_B.sum() / n_seq
    if loss_agg == "seq-mean-token-mean":
        per_seq_B = seq_sum_B / mask_BT.sum(dim=-1).clamp(min=1).to(x_BT.dtype)
        return per_seq_B.sum() / n_seq
    if loss_agg == "seq-mean-token-sum-norm":
        length = norm_length if norm_length is not None else max(1, x_BT.shape[-1])
        return seq_sum_B.sum() / (n_seq * length)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def mismatch_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: MismatchConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights for the rollout/training mismatch (see `MismatchConfig`).

    Args:
        old_logp_BT: the trainer's behaviour logprobs.
        rollout_logp_BT: the rollout engine's logprobs.
        mask_BT: bool, True on loss tokens (the sums of the sequence levels run over them).
        cfg: level, mode and bounds.

    Returns:
        ``(weight_BT, stats)``: the weights (0 on masked tokens) and per-token ``[B, T]``
        tensors ``rho`` (the raw weight, log clamped to +-30 for reporting) and ``clipped``
        (1 where truncated or masked out).
    """
    mask_BT = mask_BT.bool()
    zero = torch.zeros_like(old_logp_BT)
    log_w_BT = torch.where(mask_BT, old_logp_BT.detach() - rollout_logp_BT.detach(), zero)
    if cfg.level == "token":
        log_rho_BT = log_w_BT
    else:
        seq_B = log_w_BT.sum(dim=-1)
        if cfg.level == "geometric":
            seq_B = seq_B / mask_BT.sum(dim=-1).clamp(min=1).to(seq_B.dtype)
        log_rho_BT = seq_B.unsqueeze(-1).expand_as(log_w_BT)
    log_hi = math.log(cfg.upper)
    if cfg.mode == "truncate":
        # exp(min(x, log C)) == min(exp(x), C) without overflowing on long sequences
        weight_BT = torch.exp(log_rho_BT.clamp(max=log_hi))
        clipped_BT = log_rho_BT > log_hi
    else:
        log_lo = math.log(cfg.lower if cfg.lower is not None else 1.0 / cfg.upper)
        inside_BT = (log_rho_BT >= log_lo) & (log_rho_BT <= log_hi)
        weight_BT = torch.where(inside_BT, torch.exp(log_rho_BT.clamp(max=log_hi)), zero)
        clipped_BT = ~inside_BT
    weight_BT = torch.where(mask_BT, weight_BT, zero)
    rho_BT = torch.exp(log_rho_BT.clamp(-_LOG_W_REPORT, _LOG_W_REPORT))
    return weight_BT, {"rho": rho_BT, "clipped": (clipped_BT & mask_BT).to(zero.dtype)}


def _ppo_terms(
    ratio_BT: torch.Tensor, adv_BT: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate per token and where the clipped (or dual-clip) term is active."""
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)
    active_BT = clipped_BT > unclipped_BT
    if cfg.dual_clip is not None:
        cap_BT = -adv_BT * cfg.dual_clip  # > 0 where A < 0
        capped_BT = (adv_BT < 0) & (pg_BT > cap_BT)
        pg_BT = torch.where(capped_BT, cap_BT, pg_BT)
        active_BT = active_BT | capped_BT
    return pg_BT, active_BT


def _call_user_loss(
    cfg: LossConfig, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    fn = resolve_function(cfg.name, "trainer.loss.name")
    out = fn(ctx)
    pg_BT, extra = out if isinstance(out, tuple) else (out, {})
    if not isinstance(pg_BT, torch.Tensor) or pg_BT.shape != ctx.logp_BT.shape:
        raise ValueError(
            f"loss {cfg.name!r} must return a [B, T] tensor of shape {tuple(ctx.logp_BT.shape)} "
            f"(or (tensor, metrics)), got {getattr(pg_BT, 'shape', type(pg_BT).__name__)}"
        )
    return pg_BT, dict(extra)


# ---------------------------------------------------------------------------------- the hub


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    rollout_logp_BT: torch.Tensor | None = None,
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The RL loss of one micro-batch: policy term, IS correction, KL penalty, entropy bonus.

    Per token, with ``A`` the advantage and ``lo, hi = cfg.clip_low, cfg.clip_high``:

    - ``name="ppo"``: ``r = exp(logp - old_logp)``, ``pg = max(-A r, -A clip(r, 1-lo, 1+hi))``;
      with ``dual_clip = c`` and ``A < 0``, ``pg = min(pg, -c A)``.
    - ``name="gspo"``: the sequence ratio ``s_i = exp(mean_t (logp - old_logp))`` over the
      sequence's loss tokens replaces ``r`` for every token of the sequence (its gradient
      reaches each token as ``s_i * d logp_t``, GSPO-token), clipped the same way.
    - a user function: ``pg = fn(LossContext)``.

    Then ``pg *= w`` with the detached mismatch weight `mismatch_weights` when ``cfg.mismatch``
    is set, and over the batch, with ``agg`` per `aggregate` and ``k`` per `kl_estimate`::

        loss = agg(pg) + cfg.kl_coef * agg(k) - cfg.entropy_coef * agg(entropy)

    ``old_logp``, ``ref_logp``, ``rollout_logp`` and ``advantages`` are treated as constants.

    Args:
        logp_BT: current-policy logprobs of the sampled tokens (carries the gradient).
        old_logp_BT: behaviour-policy logprobs (the ratio's denominator).
        advantages_BT: per-token advantages.
        mask_BT: bool or 0/1; 1 where the token counts.
        cfg: the loss configuration.
        ref_logp_BT: reference-model logprobs; required when ``cfg.kl_coef > 0``; when given
            with ``kl_coef == 0`` the KL is only reported.
        entropy_BT: per-token entropy of the current policy (with grad if
            ``cfg.entropy_coef > 0``); required when ``cfg.entropy_coef > 0``.
        rollout_logp_BT: the rollout engine's logprobs; required when ``cfg.mismatch`` is set.
        num_global_tokens: loss tokens in the global batch (see `aggregate`).
        num_global_seqs: sequences in the global batch (see `aggregate`).
        norm_length: the length of "seq-mean-token-sum-norm" (default ``cfg.norm_length``,
            else ``T``).

    Returns:
        ``(loss, metrics)``: the scalar loss and detached 0-dim metrics, partial sums over this
        batch with global counts: ``pg_loss``, ``kl``, ``entropy`` (aggregated like the loss; 0
        when not given), token means ``clip_frac`` (loss tokens whose clipped term is active),
        ``ratio_mean`` and ``approx_kl`` (``r - 1 - log r``, the k3 estimate of
        KL(old || current)); with ``cfg.mismatch`` also ``is_weight_mean`` (applied weight),
        ``is_clip_frac`` (truncated or masked out), and ``is_weight_max`` / ``is_weight_min``
        (raw weight; reduce these two by max / min, not by sum); a user loss's extra per-token
        metrics as token means under their own names.

    Raises:
        ValueError: shape mismatches, or a term the config enables is missing its input.
    """
    shape = logp_BT.shape
    named: dict[str, torch.Tensor | None] = {
        "old_logp_BT": old_logp_BT,
        "advantages_BT": advantages_BT,
        "mask_BT": mask_BT,
        "ref_logp_BT": ref_logp_BT,
        "entropy_BT": entropy_BT,
        "rollout_logp_BT": rollout_logp_BT,
    }
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp_BT has {tuple(shape)}")
    if cfg.kl_coef > 0 and ref_logp_BT is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_logp_BT")
    if cfg.entropy_coef > 0 and entropy_BT is None:
        raise ValueError("cfg.entropy_coef > 0 needs entropy_BT")
    if cfg.mismatch is not None and rollout_logp_BT is None:
        raise ValueError("cfg.mismatch needs rollout_logp_BT")

    mask_BT = mask_BT.bool()

    def keep(x_BT: torch.Tensor) -> torch.Tensor:
        # where(), not a product: 0 * inf would be nan, in the loss and in the gradient.
        return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))

    logp_BT = keep(logp_BT)
    old_logp_BT = keep(old_logp_BT.detach())
    adv_BT = keep(advantages_BT.detach())
    ref_logp_BT = None if ref_logp_BT is None else keep(ref_logp_BT.detach())
    entropy_BT = None if entropy_BT is None else keep(entropy_BT)
    rollout_logp_BT = None if rollout_logp_BT is None else keep(rollout_logp_BT.detach())
    length = norm_length if norm_length is not None else cfg.norm_length

    def agg(x_BT: torch.Tensor, mode: str = cfg.loss_agg) -> torch.Tensor:
        return aggregate(
            x_BT,
            mask_BT,
            mode,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
            norm_length=length,
        )

    log_ratio_BT = logp_BT - old_logp_BT
    extra: dict[str, torch.Tensor] = {}
    if cfg.name == "ppo":
        ratio_BT = torch.exp(log_ratio_BT)
        pg_BT, active_BT = _ppo_terms(ratio_BT, adv_BT, cfg)
    elif cfg.name == "gspo":
        n_B = mask_BT.sum(dim=-1).clamp(min=1).to(logp_BT.dtype)
        seq_log_ratio_B = log_ratio_BT.detach().sum(dim=-1) / n_B
        # value s_i on every token, gradient s_i * d logp_t (GSPO-token, Zheng et al. 2025)
        token_log_s_BT = seq_log_ratio_B.unsqueeze(-1) + logp_BT - logp_BT.detach()
        ratio_BT = keep(torch.exp(token_log_s_BT))
        pg_BT, active_BT = _ppo_terms(ratio_BT, adv_BT, cfg)
    else:
        ratio_BT = torch.exp(log_ratio_BT)
        ctx = LossContext(
            logp_BT=logp_BT,
            old_logp_BT=old_logp_BT,
            advantages_BT=adv_BT,
            mask_BT=mask_BT,
            rollout_logp_BT=rollout_logp_BT,
            entropy_BT=entropy_BT,
            params=cfg.params,
        )
        pg_BT, extra = _call_user_loss(cfg, ctx)
        active_BT = torch.zeros_like(mask_BT)

    stats: dict[str, torch.Tensor] = {}
    if cfg.mismatch is not None:
        assert rollout_logp_BT is not None
        weight_BT, stats = mismatch_weights(old_logp_BT, rollout_logp_BT, mask_BT, cfg.mismatch)
        pg_BT = pg_BT * weight_BT
    pg_loss = agg(pg_BT)
    loss = pg_loss

    zero = pg_loss.detach().new_zeros(())
    kl = zero
    if ref_logp_BT is not None:
        kl = agg(kl_estimate(logp_BT, ref_logp_BT, cfg.kl_type))
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    entropy = zero
    if entropy_BT is not None:
        entropy = agg(entropy_BT)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy

    with torch.no_grad():
        dt = pg_BT.dtype

        def token_mean(x_BT: torch.Tensor) -> torch.Tensor:
            return agg(x_BT.to(dt), "token-mean")

        r_BT = ratio_BT.detach()
        metrics = {
            "pg_loss": pg_loss.detach(),
            "kl": kl.detach(),
            "entropy": entropy.detach(),
            "clip_frac": token_mean(active_BT),
            "ratio_mean": token_mean(r_BT),
            "approx_kl": token_mean(keep(r_BT - 1.0 - torch.log(r_BT.clamp(min=1e-30)))),
        }
        if stats:
            metrics["is_weight_mean"] = token_mean(weight_BT)
            metrics["is_clip_frac"] = token_mean(stats["clipped"])
            rho_BT = stats["rho"]
            big = torch.finfo(rho_BT.dtype).max
            metrics["is_weight" + MAX_SUFFIX] = torch.where(mask_BT, rho_BT, -big).max()
            metrics["is_weight" + MIN_SUFFIX] = torch.where(mask_BT, rho_BT, big).min()
        for name, x_BT in extra.items():
            if name in metrics:
                raise ValueError(f"loss {cfg.name!r} returned metric {name!r}, a built-in name")
            metrics[name] = token_mean(keep(x_BT.detach()))
    return loss, metrics


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    value_clip: float | None,
    loss_agg: str = "token-mean",
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss for the critic.

    Per token, with ``V`` the critic's value (with grad), ``V_old`` its value before the update
    and ``R`` the return (GAE advantage + ``V_old``)::

        V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
        vl     = 0.5 * max((V - R)^2, (V_clip - R)^2)        (0.5 * (V - R)^2 without a clip)
        loss   = agg(vl)

    Returns:
        ``(loss, metrics)``: ``value_loss``, token means ``value_clip_frac`` (clipped term
        larger), ``values_mean`` and ``returns_mean``; partial sums as in `policy_loss`.
    """
    mask_BT = mask_BT.bool()

    def keep(x_BT: torch.Tensor) -> torch.Tensor:
        return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))

    v_BT = keep(values_BT)
    old_BT = keep(old_values_BT.detach())
    ret_BT = keep(returns_BT.detach())
    plain_BT = 0.5 * (v_BT - ret_BT).square()
    clipped_frac_BT = torch.zeros_like(plain_BT)
    vl_BT = plain_BT
    if value_clip is not None:
        delta_BT = v_BT - old_BT
        # V itself where the update is within the clip: old + (V - old) can differ from V in
        # the last bit, which would make the clipped term "win" on ties.
        inside_BT = delta_BT.abs() <= value_clip
        v_clip_BT = torch.where(inside_BT, v_BT, old_BT + delta_BT.clamp(-value_clip, value_clip))
        clip_BT = 0.5 * (v_clip_BT - ret_BT).square()
        vl_BT = torch.maximum(plain_BT, clip_BT)
        clipped_frac_BT = (clip_BT > plain_BT).to(plain_BT.dtype)

    def agg(x_BT: torch.Tensor, mode: str = loss_agg) -> torch.Tensor:
        return aggregate(
            x_BT,
            mask_BT,
            mode,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
            norm_length=norm_length,
        )

    loss = agg(vl_BT)
    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_frac": agg(clipped_frac_BT, "token-mean"),
            "values_mean": agg(v_BT.detach(), "token-mean"),
            "returns_mean": agg(ret_BT, "token-mean"),
        }
    return loss, metrics
