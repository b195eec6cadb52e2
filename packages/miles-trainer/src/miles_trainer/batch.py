"""`TrainBatch` (what the loop hands the trainer) and its packing into padded micro-batches."""

# Tensor fields carry their shape in their names (input_ids_BL), as everywhere in this repo.
# ruff: noqa: N815

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "TrainBatch", "pack_micro_batch"]


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """A batch of trajectories to train on, one entry per sample in every list.

    Token convention (docs/architecture.md): ``tokens[i] = prompt_ids + response_ids`` and
    ``response_lengths[i] = len(response_ids)``; the other lists cover the response only.

    Attributes:
        tokens: prompt + response token ids per sample; the prompt has at least one token.
        response_lengths: response length per sample, in ``[0, len(tokens[i]) - 1]``.
        loss_masks: per response token, 1 if the model generated it (trained on), 0 if not
            (tool output, observations).
        rollout_logprobs: per response token, the rollout engine's logprob
            ``log_softmax(logits / T)[token]`` (finite; any finite value where the mask is 0).
        advantages: per response token (an outcome reward repeats one value per sample).

    Raises:
        ValueError: on any length mismatch or bad value, naming the sample index.
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    rollout_logprobs: list[list[float]]
    advantages: list[list[float]]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("TrainBatch is empty")
        for name in ("response_lengths", "loss_masks", "rollout_logprobs", "advantages"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"TrainBatch.{name} has {got} entries, tokens has {n}")
        for i in range(n):
            length, r = len(self.tokens[i]), self.response_lengths[i]
            if not 0 <= r <= length - 1:
                raise ValueError(
                    f"sample {i}: response_length {r} must be in [0, len(tokens) - 1 = "
                    f"{length - 1}] (the prompt needs at least one token)"
                )
            for name in ("loss_masks", "rollout_logprobs", "advantages"):
                got = len(getattr(self, name)[i])
                if got != r:
                    raise ValueError(
                        f"sample {i}: len({name}[{i}]) = {got} but response_length = {r} "
                        "(it covers the response tokens only)"
                    )
            if any(m not in (0, 1) for m in self.loss_masks[i]):
                raise ValueError(f"sample {i}: loss_masks[{i}] must hold only 0 and 1")
            if any(t < 0 for t in self.tokens[i]):
                raise ValueError(f"sample {i}: tokens[{i}] holds a negative token id")
            for name in ("rollout_logprobs", "advantages"):
                if not all(map(math.isfinite, getattr(self, name)[i])):
                    raise ValueError(f"sample {i}: {name}[{i}] holds a non-finite value")

    def __len__(self) -> int:
        return len(self.tokens)

    def num_loss_tokens(self, indices: list[int] | range | None = None) -> int:
        """Number of tokens with loss mask 1 in the given samples (default: all)."""
        idx = range(len(self)) if indices is None else indices
        return sum(sum(self.loss_masks[i]) for i in idx)


@dataclass(slots=True)
class MicroBatch:
    """Right-padded tensors of a few samples. R = longest response, L = longest sequence.

    Attributes:
        indices: the samples' indices in the `TrainBatch`.
        response_lengths: the samples' response lengths.
        input_ids_BL: token ids, padded with 0 (padding sits after every real token, so a
            causal model's outputs at real positions do not see it).
        logit_pos_BR: for each response token, the position whose logits predict it
            (``prompt_len - 1 + j``); padding points at position 0.
        targets_BR: the response token ids (0 in padding).
        mask_BR: the loss mask (False in padding).
        rollout_logp_BR: rollout logprobs (0 in padding).
        advantages_BR: advantages (0 in padding).
    """

    indices: list[int]
    response_lengths: list[int]
    input_ids_BL: torch.Tensor
    logit_pos_BR: torch.Tensor
    targets_BR: torch.Tensor
    mask_BR: torch.Tensor
    rollout_logp_BR: torch.Tensor
    advantages_BR: torch.Tensor

    def unpad(self, x_BR: torch.Tensor) -> list[list[float]]:
        """Per sample, the first ``response_length`` values of a ``[B, R]`` tensor."""
        rows: list[list[float]] = x_BR.detach().float().cpu().tolist()
        return [row[:r] for row, r in zip(rows, self.response_lengths)]


def pack_micro_batch(batch: TrainBatch, indices: list[int], device: torch.device) -> MicroBatch:
    """Pad the samples ``indices`` of ``batch`` into one `MicroBatch` on ``device``."""
    assert indices, "a micro-batch needs at least one sample"
    B = len(indices)
    L = max(len(batch.tokens[i]) for i in indices)
    R = max(batch.response_lengths[i] for i in indices)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    logit_pos = torch.zeros(B, R, dtype=torch.long)
    targets = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R, dtype=torch.bool)
    rollout = torch.zeros(B, R, dtype=torch.float32)
    adv = torch.zeros(B, R, dtype=torch.float32)
    for b, i in enumerate(indices):
        toks, r = batch.tokens[i], batch.response_lengths[i]
        input_ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        if r == 0:
            continue
        start = len(toks) - r
        logit_pos[b, :r] = torch.arange(start - 1, start - 1 + r)
        targets[b, :r] = torch.tensor(toks[start:], dtype=torch.long)
        mask[b, :r] = torch.tensor(batch.loss_masks[i], dtype=torch.bool)
        rollout[b, :r] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        adv[b, :r] = torch.tensor(batch.advantages[i], dtype=torch.float32)
    return MicroBatch(
        indices=list(indices),
        response_lengths=[batch.response_lengths[i] for i in indices],
        input_ids_BL=input_ids.to(device),
        logit_pos_BR=logit_pos.to(device),
        targets_BR=targets.to(device),
        mask_BR=mask.to(device),
        rollout_logp_BR=rollout.to(device),
        advantages_BR=adv.to(device),
    )
