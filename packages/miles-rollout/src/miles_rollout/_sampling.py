"""Batched token sampling with per-request parameters and counter-based randomness.

Randomness: each sampled token uses one uniform number ``u = splitmix64(seed, step)``, a pure
function of the request's seed and the output position, and picks the token by inverse-CDF
search. So a seeded request gives the same tokens whatever else is in the batch, and a
request that is retracted and re-prefilled continues with the same random stream. One uniform
per token (instead of one per vocabulary entry, as Gumbel or exponential tricks need) also keeps
the per-step cost low.

Logprobs are ``log_softmax(logits / temperature)`` (temperature 1 when greedy), taken before
top-k / top-p / min-p truncation (the contract in ``docs/architecture.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_rollout.sampling_params import SamplingParams

__all__ = ["BatchSampler", "uniform"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, step: int) -> float:
    """The ``step``-th number in ``[0, 1)`` of the SplitMix64 stream seeded by ``seed``."""
    return (_mix64((_mix64(seed & _MASK64) + (step + 1) * _GOLDEN) & _MASK64) >> 11) * 2.0**-53


class BatchSampler:
    """Samples one token per row from ``[n, vocab]`` float32 logits.

    Rebuild (``BatchSampler(params)``) whenever the batch's rows change; per-row parameter
    tensors are built once here, not per step.
    """

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int) -> None:
        self.n = len(params)
        self.vocab_size = vocab_size
        greedy = [p.is_greedy for p in params]
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        self.greedy = torch.tensor(greedy, dtype=torch.bool)
        temps = [1.0 if p.temperature == 0.0 else float(p.temperature) for p in params]
        self.all_temp_one = all(t == 1.0 for t in temps)
        self.temps = torch.tensor(temps, dtype=torch.float32)[:, None]
        trunc = [
            i
            for i, p in enumerate(params)
            if not greedy[i] and (p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0)
        ]
        self.trunc_rows = torch.tensor(trunc, dtype=torch.long)
        self.has_trunc = bool(trunc)
        if trunc:
            sub = [params[i] for i in trunc]
            ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in sub]
            self.top_k = torch.tensor(ks, dtype=torch.long)[:, None]
            self.k_max = max(ks)
            self.top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32)[:, None]
            self.any_top_p = any(p.top_p < 1.0 for p in sub)
            self.min_p = torch.tensor([p.min_p for p in sub], dtype=torch.float32)[:, None]
            self.any_min_p = any(p.min_p > 0.0 for p in sub)

    def sample(
        self, logits: torch.Tensor, uniforms: Sequence[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(tokens [n] int64, logprobs [n] float32)``.

        Args:
            logits: ``[n, vocab]`` float32.
            uniforms: one number in ``[0, 1)`` per row (ignored for greedy rows).
        """
        assert logits.dtype == torch.float32, logits.dtype
        assert logits.shape[0] == self.n, (logits.shape, self.n)
        scaled = logits if self.all_temp_one else logits / self.temps
        logp = torch.log_softmax(scaled, dim=-1)
        if self.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            u = torch.tensor(uniforms, dtype=torch.float64)
            probs = logp.exp()
            tokens = _inverse_cdf(probs, u)
            if self.has_trunc:
                rows = self.trunc_rows
                tokens[rows] = self._sample_truncated(probs[rows], u[rows])
            if self.any_greedy:
                tokens = torch.where(self.greedy, logits.argmax(dim=-1), tokens)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]

    def _sample_truncated(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        # Candidates in descending probability: top-k keeps a prefix, top-p keeps the prefix
        # whose mass before each token is <= top_p (SGLang's rule), min-p keeps tokens with
        # p >= min_p * p_max; sampling then happens in candidate order.
        if self.k_max < self.vocab_size:
            vals, idx = probs.topk(self.k_max, dim=-1)
        else:
            vals, idx = probs.sort(dim=-1, descending=True)
        drop = torch.arange(vals.shape[1])[None, :] >= self.top_k
        if self.any_top_p:
            drop |= (vals.cumsum(dim=-1) - vals) > self.top_p
        if self.any_min_p:
            drop |= vals < self.min_p * vals[:, :1]
        vals = vals.masked_fill(drop, 0.0)
        picked = _inverse_cdf(vals, u)
        return idx.gather(1, picked[:, None])[:, 0]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Pick index ``i`` with probability ``weights[i] / sum(weights)`` using ``u`` in [0, 1).

    The CDF is accumulated in float64 so the sampled distribution matches the weights to well
    below float32 resolution; a zero weight is never picked.
    """
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0]
