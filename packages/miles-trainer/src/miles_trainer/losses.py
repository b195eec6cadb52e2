"""The clipped policy-gradient loss (PPO / GRPO / DAPO) with KL, entropy and TIS terms.

All per-token tensors are ``[B, T]`` (B sequences, T response positions, right-padded); the
mask marks the tokens that count. Masked-out positions may hold any value, even inf or nan:
`policy_loss` replaces them with 0 before any arithmetic, so they reach neither the loss nor
the gradient.
"""

from __future__ import annotations

import torch

from miles_trainer.config import LossConfig

__all__ = ["aggregate", "kl_estimate", "policy_loss"]


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token Schulman estimator of KL(pi || ref) for tokens sampled from pi.

    With ``d = logp - ref_logp`` (so ``ref / pi = exp(-d)``)::

        k1 = d
        k2 = d^2 / 2
        k3 = exp(-d) - 1 + d        (unbiased, always >= 0)

    Args:
        logp_BT: policy logprobs of the sampled tokens (with grad).
        ref_logp_BT: reference-model logprobs of the same tokens (treated as constants).
        kl_type: "k1", "k2" or "k3".

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
    raise ValueError(f"kl_type must be 'k1', 'k2' or 'k3', got {kl_type!r}")


def aggregate(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    loss_agg: str,
    *,
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar per ``loss_agg``.

    With ``m`` the mask, ``N_tok`` the number of loss tokens and ``N_seq`` the number of
    sequences of the *global* batch::

        token-mean:           sum_{i,t} m x / N_tok
        seq-mean-token-sum:   sum_i (sum_t m x) / N_seq
        seq-mean-token-mean:  sum_i (sum_t m x / max(1, sum_t m)) / N_seq

    The global counts default to this batch's (``mask.sum()`` floored at 1, and ``B``). Passing
    the global counts makes the result a partial sum: summing it over micro-batches and ranks
    gives the value of one big batch.

    Args:
        x_BT: per-token values.
        mask_BT: bool or 0/1 mask, same shape.
        loss_agg: "token-mean", "seq-mean-token-sum" or "seq-mean-token-mean".
        num_global_tokens: loss tokens in the global batch (token-mean).
        num_global_seqs: sequences in the global batch (the seq-mean modes).

    Returns:
        A 0-dim tensor.
    """
    mask_BT = mask_BT.bool()
    x_BT = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT))
    if loss_agg == "token-mean":
        denom = num_global_tokens if num_global_tokens is not None else max(1, int(mask_BT.sum()))
        return x_BT.sum() / denom
    seq_sum_B = x_BT.sum(dim=-1)
    if loss_agg == "seq-mean-token-sum":
        per_seq_B = seq_sum_B
    elif loss_agg == "seq-mean-token-mean":
        per_seq_B = seq_sum_B / mask_BT.sum(dim=-1).clamp(min=1).to(x_BT.dtype)
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    denom = num_global_seqs if num_global_seqs is not None else max(1, x_BT.shape[0])
    return per_seq_B.sum() / denom


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss with optional KL penalty, entropy bonus and TIS.

    Per token, with ``A`` the advantage and ``eps_lo, eps_hi = cfg.clip_low, cfg.clip_high``::

        ratio = exp(logp - old_logp)
        pg    = max(-A * ratio, -A * clip(ratio, 1 - eps_lo, 1 + eps_hi))
        pg    = pg * min(exp(old_logp - rollout_logp), cfg.tis_cap)    (if tis_cap; detached)

    and over the batch, with ``agg`` per `aggregate` and ``kl`` per `kl_estimate`::

        loss = agg(pg) + cfg.kl_coef * agg(kl) - cfg.entropy_coef * agg(entropy)

    ``old_logp``, ``ref_logp``, ``rollout_logp`` and ``advantages`` are treated as constants.

    Args:
        logp_BT: current-policy logprobs of the sampled tokens (carries the gradient).
        old_logp_BT: behaviour-policy logprobs (the PPO ratio's denominator).
        advantages_BT: per-token advantages.
        mask_BT: bool or 0/1; 1 where the token counts.
        cfg: the loss configuration.
        ref_logp_BT: reference-model logprobs; required when ``cfg.kl_coef > 0``; when given
            with ``kl_coef == 0`` the KL is only reported.
        entropy_BT: per-token entropy of the current policy (with grad if
            ``cfg.entropy_coef > 0``); required when ``cfg.entropy_coef > 0``.
        rollout_logp_BT: the rollout engine's logprobs; required when ``cfg.tis_cap`` is set.
        num_global_tokens: loss tokens in the global batch (see `aggregate`).
        num_global_seqs: sequences in the global batch (see `aggregate`).

    Returns:
        ``(loss, metrics)``: the scalar loss and detached 0-dim metrics ``pg_loss``, ``kl``,
        ``entropy`` (aggregated like the loss; 0 when not given), ``clip_frac`` (fraction of
        loss tokens whose clipped term is the active one) and ``ratio_mean`` (token mean of the
        ratio). With global counts every metric is a partial sum over this batch, like the loss.

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
    if cfg.tis_cap is not None and rollout_logp_BT is None:
        raise ValueError("cfg.tis_cap needs rollout_logp_BT")

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

    def agg(x_BT: torch.Tensor, mode: str = cfg.loss_agg) -> torch.Tensor:
        return aggregate(
            x_BT,
            mask_BT,
            mode,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
        )

    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)
    if cfg.tis_cap is not None:
        assert rollout_logp_BT is not None
        tis_BT = torch.exp(old_logp_BT - rollout_logp_BT.detach()).clamp(max=cfg.tis_cap)
        pg_BT = pg_BT * tis_BT
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
        clip_frac = agg((clipped_BT > unclipped_BT).to(pg_BT.dtype), "token-mean")
        ratio_mean = agg(ratio_BT, "token-mean")
    metrics = {
        "pg_loss": pg_loss.detach(),
        "kl": kl.detach(),
        "entropy": entropy.detach(),
        "clip_frac": clip_frac,
        "ratio_mean": ratio_mean,
    }
    return loss, metrics
