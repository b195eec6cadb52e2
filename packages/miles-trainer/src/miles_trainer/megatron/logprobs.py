"""Response logprobs and entropies from vocabulary-parallel logits (each TP rank holds V/tp).

The same contract as ``miles_trainer.logprobs.response_logprobs`` (``log_softmax(float32(logits)
/ T)[token]``), computed without gathering the vocabulary: megatron-core's vocab-parallel cross
entropy gives the logprobs, and the entropy's two vocabulary sums are all-reduced over the TP
group. Padded vocabulary entries (Megatron rounds the vocabulary up) are masked out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

__all__ = ["vocab_parallel_response_logprobs"]


def vocab_parallel_response_logprobs(
    logits_BLv: torch.Tensor,
    logit_pos_BR: torch.Tensor,
    targets_BR: torch.Tensor,
    temperature: float,
    *,
    vocab_size: int,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and optionally entropies) of response tokens; collective over the TP group.

    With ``z = float32(logits[p]) / T`` at the position ``p`` predicting each token::

        logp    = z[target] - logsumexp(z)
        entropy = logsumexp(z) - sum_v softmax(z)_v * z_v

    Args:
        logits_BLv: this rank's vocabulary slice of the logits, ``[B, L, Vp / tp]``.
        logit_pos_BR: positions whose logits predict each response token.
        targets_BR: the response token ids (global vocabulary ids).
        temperature: > 0.
        vocab_size: the real vocabulary size; ids at or above it are padding.
        with_entropy: also return the entropy.
        entropy_grad: let the entropy carry a gradient.

    Returns:
        ``(logp_BR, entropy_BR or None)``, float32, the same on every TP rank.
    """
    v_local = logits_BLv.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    index_BRv = logit_pos_BR.unsqueeze(-1).expand(-1, -1, v_local)
    z_BRv = logits_BLv.gather(1, index_BRv).float() / temperature
    if start + v_local > vocab_size:
        # Padding rows: a logit of float32's lowest value has probability exactly 0 and adds
        # exactly 0 to every sum (0 * finite), unlike -inf (0 * -inf = nan in the entropy).
        pad_v = torch.arange(start, start + v_local, device=z_BRv.device) >= vocab_size
        z_BRv = z_BRv.masked_fill(pad_v, torch.finfo(torch.float32).min)
    entropy_BR = None
    if with_entropy:
        zz_BRv = z_BRv if entropy_grad else z_BRv.detach()
        entropy_BR = _entropy(zz_BRv)
    # The cross entropy subtracts the max in place: give it its own tensor when the entropy's
    # graph still needs z.
    ce_in = z_BRv.clone() if with_entropy and entropy_grad else z_BRv
    logp_BR = -tensor_parallel.vocab_parallel_cross_entropy(ce_in, targets_BR)
    return logp_BR, entropy_BR


def _entropy(z_BRv: torch.Tensor) -> torch.Tensor:
    group = ps.get_tensor_model_parallel_group()
    max_BR = z_BRv.detach().amax(dim=-1)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(max_BR, op=dist.ReduceOp.MAX, group=group)
    e_BRv = torch.exp(z_BRv - max_BR.unsqueeze(-1))
    # reduce_from_...: all-reduce forward, identity backward (every TP rank computes the same
    # loss from the sums, so each rank's slice gets the sum's gradient).
    sum_BR = tensor_parallel.reduce_from_tensor_model_parallel_region((e_BRv).sum(dim=-1))
    ez_BR = tensor_parallel.reduce_from_tensor_model_parallel_region((e_BRv * z_BRv).sum(dim=-1))
    return max_BR + torch.log(sum_BR) - ez_BR / sum_BR
