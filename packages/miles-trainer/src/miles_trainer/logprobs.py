"""Teacher-forced logprobs and entropies of response tokens, per the rollout logprob contract."""

from __future__ import annotations

import torch

__all__ = ["response_logprobs"]


def response_logprobs(
    logits_BLV: torch.Tensor,
    logit_pos_BR: torch.Tensor,
    targets_BR: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and optionally entropies) of response tokens from a causal LM's logits.

    For the token predicted at flat position ``p`` (``logit_pos_BR``)::

        z       = float32(logits[p]) / temperature
        logp    = z[target] - logsumexp(z)           == log_softmax(z)[target]
        entropy = logsumexp(z) - sum_v softmax(z)_v * z_v

    which is the rollout contract's ``log_softmax(logits_fp32 / temperature)[token]``. Only
    the response positions are upcast to float32, not the whole ``[B, L, V]`` tensor.

    Args:
        logits_BLV: model output logits (any float dtype).
        logit_pos_BR: for each response token, the flat index into ``logits.reshape(-1, V)``
            of the position that predicts it (padded ``[B, L]`` rows or one packed row).
        targets_BR: the response token ids.
        temperature: > 0.
        with_entropy: also return the per-token entropy.
        entropy_grad: let the entropy carry a gradient; False computes it from detached
            logits (cheaper: autograd keeps no softmax for it).

    Returns:
        ``(logp_BR, entropy_BR or None)``, float32.
    """
    V = logits_BLV.shape[-1]
    z_BRV = logits_BLV.reshape(-1, V)[logit_pos_BR].float() / temperature
    lse_BR = torch.logsumexp(z_BRV, dim=-1)
    logp_BR = z_BRV.gather(-1, targets_BR.unsqueeze(-1)).squeeze(-1) - lse_BR
    entropy_BR = None
    if with_entropy:
        zz_BRV, zlse_BR = (z_BRV, lse_BR) if entropy_grad else (z_BRV.detach(), lse_BR.detach())
        entropy_BR = zlse_BR - (torch.softmax(zz_BRV, dim=-1) * zz_BRV).sum(dim=-1)
    return logp_BR, entropy_BR
