"""Per-step metric accumulation shared by the backends: partial sums, maxima and minima.

`policy_loss` and `value_loss` return global partial sums (normalised by the mini-batch's
global counts), except metrics named ``*_max`` / ``*_min``. Summing the partial sums over the
micro-batches and ranks of a mini-batch gives the mini-batch's value; a step reports the mean
over its mini-batches (and the max / min over all of them).
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist

from miles_trainer.batch import MicroBatch, TrainBatch
from miles_trainer.losses import MAX_SUFFIX, MIN_SUFFIX

__all__ = ["StepMetrics", "token_mean", "version_metrics"]


class StepMetrics:
    """Collects one train step's loss metrics per mini-batch; `reduce` all-reduces once.

    Every rank must `add` the same keys (filler passes add theirs with ``real=False``), so
    that the all-reduced tensors line up.
    """

    def __init__(self, num_minibatches: int) -> None:
        self._k = num_minibatches
        self._sums: dict[str, list[torch.Tensor | float]] = {}
        self._ext: dict[str, torch.Tensor | float] = {}

    def add(self, k: int, metrics: dict[str, torch.Tensor], *, real: bool = True) -> None:
        """Add one micro-batch's metrics to mini-batch ``k``."""
        for name, value in metrics.items():
            if name.endswith(MAX_SUFFIX) or name.endswith(MIN_SUFFIX):
                prev = self._ext.get(name)
                if not real:
                    self._ext.setdefault(name, -math.inf)
                    continue
                sign = 1.0 if name.endswith(MAX_SUFFIX) else -1.0
                v = sign * value.detach().double()
                self._ext[name] = (
                    v if not isinstance(prev, torch.Tensor) else torch.maximum(prev, v)
                )
                continue
            row = self._sums.setdefault(name, [0.0] * self._k)
            if real:
                row[k] = row[k] + value.detach().double()

    def local_sum(self, name: str, k: int) -> float:
        """This rank's partial sum of ``name`` in mini-batch ``k`` (a sync point)."""
        return float(self._sums[name][k]) if name in self._sums else 0.0

    def reduce(self, device: torch.device, world: int) -> dict[str, float]:
        """Mean over mini-batches of the summed metrics, max / min of the others (collective)."""
        names = sorted(self._sums)
        sums_KM = torch.zeros(self._k, len(names), dtype=torch.float64, device=device)
        for j, name in enumerate(names):
            for k, v in enumerate(self._sums[name]):
                sums_KM[k, j] = v
        ext_names = sorted(self._ext)
        ext_E = torch.tensor(
            [float(self._ext[n]) for n in ext_names], dtype=torch.float64, device=device
        )
        if world > 1:
            dist.all_reduce(sums_KM)
            if ext_names:
                dist.all_reduce(ext_E, op=dist.ReduceOp.MAX)
        out = {name: float(v) for name, v in zip(names, sums_KM.mean(dim=0).tolist())}
        big = float(torch.finfo(torch.float32).max)
        for name, v in zip(ext_names, ext_E.tolist()):
            value = v if name.endswith(MAX_SUFFIX) else -v
            if math.isfinite(value) and abs(value) < big:  # no loss token at all: no extreme
                out[name] = value
        return out


def version_metrics(batch: TrainBatch) -> dict[str, float]:
    """Statistics of the weight versions of the trained tokens (none without versions).

    ``weight_versions``: distinct versions; ``stale_token_frac``: fraction of loss tokens not
    made by the newest version in the batch; ``weight_version_lag_max``: newest minus oldest
    (only when every version is an integer string).
    """
    if batch.weight_versions is None:
        return {}
    seen = Counter(
        v
        for row, mask in zip(batch.weight_versions, batch.loss_masks)
        for v, m in zip(row, mask)
        if m and v is not None
    )
    if not seen:
        return {}
    total = sum(seen.values())
    out = {"weight_versions": float(len(seen))}
    if all(v.lstrip("-").isdigit() for v in seen):
        ints = {int(v): c for v, c in seen.items()}
        newest = max(ints)
        out["weight_version_lag_max"] = float(newest - min(ints))
        out["stale_token_frac"] = 1.0 - ints[newest] / total
    return out


def token_mean(x_BR: torch.Tensor, mb: MicroBatch, n_tok: int) -> torch.Tensor:
    """Partial sum of a token mean over the mini-batch's ``n_tok`` loss tokens."""
    return torch.where(mb.mask_BR, x_BR, torch.zeros_like(x_BR)).sum().double() / n_tok
