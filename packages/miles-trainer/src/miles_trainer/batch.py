"""`TrainBatch` (what the loop hands a trainer) and its micro-batches (padded or packed).

Shared by every backend: a backend plans micro-batches with `plan_micro_batches`, builds them
with `make_micro_batch`, runs its model on ``input_ids_BL`` (and ``position_ids_BL`` when
packed), and reads each response token's logits at ``logit_pos_BR``. The loss side is always
``[B, R]``: one row per sample, whatever the forward layout.
"""

# Tensor fields carry their shape in their names (input_ids_BL), as everywhere in this repo.
# ruff: noqa: N815

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MicroBatch", "TrainBatch", "make_micro_batch", "plan_micro_batches"]

# A rollout logprob above this on a trained token is not a log-probability (fp32 rounding of
# log_softmax can give a tiny positive value for a near-certain token, never more).
_MAX_LOGPROB = 1e-3


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """A batch of trajectories to train on, one entry per sample in every list.

    Token convention (docs/architecture.md): ``tokens[i] = prompt_ids + response_ids`` and
    ``response_lengths[i] = len(response_ids)``; the per-token lists cover the response only.
    Give ``rewards`` (and ``group_ids``) and the trainer computes advantages with its
    configured estimator; or give precomputed per-token ``advantages``, which are used as they
    are (the estimator, group filter and overlong penalty are then skipped).

    Attributes:
        tokens: prompt + response token ids per sample; the prompt has at least one token.
        response_lengths: response length per sample, in ``[0, len(tokens[i]) - 1]``.
        loss_masks: per response token, 1 if the model generated it (trained on), 0 if not
            (tool output, observations): multi-turn samples have holes.
        rollout_logprobs: per response token, the rollout engine's logprob
            ``log_softmax(logits / T)[token]``: finite, and <= 0 where the mask is 1 (any
            finite value where it is 0).
        rewards: one scalar reward per sample (finite).
        group_ids: one id per sample; the samples of one prompt share it. None means every
            sample is its own group.
        advantages: precomputed per-token advantages (finite), or None.
        weight_versions: per response token, the weight version that generated it (a string;
            None where the model did not generate the token or the version is unknown), or
            None for the whole batch. Reported as metrics.
        labels: per sample, a name for error messages (e.g. "group 3, index 1"), or None.
        routed_experts: R3 (rollout routing replay), per sample the MoE experts the rollout
            engine routed each token to: an integer array (numpy, torch or nested lists)
            ``[len(tokens) - 1, num_layers, top_k]`` (SGLang's layout: row t is token t; the
            last token never went through a forward) or ``[len(tokens), ...]``; a row of -1
            has no record (a dense layer among MoE ones); None for a sample without a record,
            or None for the whole batch. Stored as int32 tensors.

    Raises:
        ValueError: on any length mismatch or bad value, naming the sample.
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    rollout_logprobs: list[list[float]]
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    advantages: list[list[float]] | None = None
    weight_versions: list[list[str | None]] | None = None
    labels: list[str] | None = None
    routed_experts: list[Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("TrainBatch is empty")
        if self.rewards is None and self.advantages is None:
            raise ValueError(
                "TrainBatch needs rewards (the trainer computes advantages) or advantages"
            )
        per_sample = ("response_lengths", "loss_masks", "rollout_logprobs", "rewards")
        extra = ("group_ids", "advantages", "weight_versions", "labels", "routed_experts")
        for name in (*per_sample, *extra):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"TrainBatch.{name} has {len(value)} entries, tokens has {n}")
        if self.routed_experts is not None:
            self.routed_experts = [_as_routed(self, i) for i in range(n)]
            _check_routed_shapes(self)
        for i in range(n):
            self._check_sample(i)

    def name(self, i: int) -> str:
        """How errors name sample ``i``: ``"sample 3"`` or ``"sample 3 (group 1, index 2)"``."""
        return f"sample {i}" if self.labels is None else f"sample {i} ({self.labels[i]})"

    def _check_sample(self, i: int) -> None:
        who = self.name(i)
        length, r = len(self.tokens[i]), self.response_lengths[i]
        if not 0 <= r <= length - 1:
            raise ValueError(
                f"{who}: response_length {r} must be in [0, len(tokens) - 1 = {length - 1}] "
                "(the prompt needs at least one token)"
            )
        for name in ("loss_masks", "rollout_logprobs", "advantages", "weight_versions"):
            rows = getattr(self, name)
            if rows is not None and len(rows[i]) != r:
                raise ValueError(
                    f"{who}: len({name}[{i}]) = {len(rows[i])} but response_length = {r} "
                    "(it covers the response tokens only)"
                )
        mask = self.loss_masks[i]
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"{who}: loss_masks[{i}] must hold only 0 and 1")
        if any(t < 0 for t in self.tokens[i]):
            raise ValueError(f"{who}: tokens[{i}] holds a negative token id")
        for name in ("rollout_logprobs", "advantages"):
            rows = getattr(self, name)
            if rows is not None and not all(map(math.isfinite, rows[i])):
                raise ValueError(f"{who}: {name}[{i}] holds a non-finite value")
        for t, (lp, m) in enumerate(zip(self.rollout_logprobs[i], mask)):
            if m and lp > _MAX_LOGPROB:
                raise ValueError(
                    f"{who}: rollout_logprobs[{i}][{t}] = {lp} on a trained token is not a "
                    "log-probability (must be <= 0): the logprobs do not belong to these tokens"
                )
        if self.rewards is not None and not math.isfinite(self.rewards[i]):
            raise ValueError(f"{who}: reward {self.rewards[i]} is not finite")
        if self.weight_versions is not None:
            for t, v in enumerate(self.weight_versions[i]):
                if v is not None and not isinstance(v, str):
                    raise ValueError(
                        f"{who}: weight_versions[{i}][{t}] is {v!r}; a version is a string "
                        "(None: not generated or unknown)"
                    )

    def __len__(self) -> int:
        return len(self.tokens)

    def num_loss_tokens(self, indices: Sequence[int] | None = None) -> int:
        """Number of tokens with loss mask 1 in the given samples (default: all)."""
        idx = range(len(self)) if indices is None else indices
        return sum(sum(self.loss_masks[i]) for i in idx)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """A new batch of the samples ``indices`` (in that order)."""

        def pick(rows: list[Any] | None) -> list[Any] | None:
            return None if rows is None else [rows[i] for i in indices]

        return TrainBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            rollout_logprobs=[self.rollout_logprobs[i] for i in indices],
            rewards=pick(self.rewards),
            group_ids=pick(self.group_ids),
            advantages=pick(self.advantages),
            weight_versions=pick(self.weight_versions),
            labels=pick(self.labels),
            routed_experts=pick(self.routed_experts),
        )

    @classmethod
    def from_samples(cls, samples: Sequence[Any]) -> TrainBatch:
        """The batch of graded rollout samples (``miles_rollout.Sample`` or alike).

        Each sample needs ``tokens``, ``response_length``, ``loss_mask``, ``rollout_logprobs``,
        ``reward`` (not None) and ``group_index`` (the group id); ``index`` names it in errors.
        Per-token weight versions come from ``weight_versions`` (one per response token, or one
        per token of ``tokens`` whose response part is taken) when the sample has a non-empty
        list, else from ``weight_version`` (one string for the whole response) when set.
        ``routed_experts`` (R3) is taken when any sample has it (None for the others).

        Raises:
            ValueError: an ungraded sample, or fields that disagree (naming the sample).
        """
        labels, versions = [], []
        any_versions = False
        for s in samples:
            label = f"group {s.group_index}, index {getattr(s, 'index', '?')}"
            labels.append(label)
            if s.reward is None:
                raise ValueError(
                    f"sample ({label}) has no reward: drop ungraded (aborted or failed) groups "
                    "before building the TrainBatch"
                )
            row = _response_versions(s, label)
            any_versions = any_versions or row is not None
            versions.append(row)
        weight_versions: list[list[str | None]] | None = None
        if any_versions:
            weight_versions = [
                row if row is not None else [None for _ in range(s.response_length)]
                for row, s in zip(versions, samples)
            ]
        routed = [getattr(s, "routed_experts", None) for s in samples]
        return cls(
            tokens=[list(s.tokens) for s in samples],
            response_lengths=[int(s.response_length) for s in samples],
            loss_masks=[list(s.loss_mask) for s in samples],
            rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
            rewards=[float(s.reward) for s in samples],
            group_ids=[int(s.group_index) for s in samples],
            weight_versions=weight_versions,
            labels=labels,
            routed_experts=routed if any(r is not None for r in routed) else None,
        )


def _as_routed(batch: TrainBatch, i: int) -> torch.Tensor | None:
    """Sample ``i``'s routed experts as an int32 tensor, checked against its tokens."""
    assert batch.routed_experts is not None
    rows = batch.routed_experts[i]
    if rows is None:
        return None
    who = batch.name(i)
    if isinstance(rows, torch.Tensor):
        t = rows
    elif hasattr(rows, "__array__"):  # numpy (maybe read-only: a decoded buffer)
        import numpy as np

        arr = np.asarray(rows)
        t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    else:
        t = torch.as_tensor(rows)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{who}: routed_experts[{i}] must hold integer expert ids, got {t.dtype}")
    n = len(batch.tokens[i])
    if t.dim() != 3 or t.shape[0] not in (n - 1, n):
        raise ValueError(
            f"{who}: routed_experts[{i}] has shape {tuple(t.shape)}; it must be [len(tokens) - 1 "
            f"= {n - 1} (or len(tokens)), num_layers, top_k]"
        )
    if t.numel():
        if int(t.min()) < -1:
            raise ValueError(f"{who}: routed_experts[{i}] holds an expert id below -1")
        none_TN = t < 0
        if not torch.equal(none_TN.any(-1), none_TN.all(-1)):
            raise ValueError(
                f"{who}: routed_experts[{i}] has a row with both expert ids and -1; a row is "
                "top_k ids, or all -1 (no record: a dense layer)"
            )
    return t.to(torch.int32)


def _check_routed_shapes(batch: TrainBatch) -> None:
    """Every sample's routed experts have the same ``[num_layers, top_k]``."""
    assert batch.routed_experts is not None
    first: torch.Tensor | None = None
    for i, t in enumerate(batch.routed_experts):
        if t is None:
            continue
        if first is None:
            first = t
        elif t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{batch.name(i)}: routed_experts[{i}] has [num_layers, top_k] = "
                f"{list(t.shape[1:])}, an earlier sample {list(first.shape[1:])}: every sample "
                "must come from the same model"
            )


def _response_versions(sample: Any, label: str) -> list[str | None] | None:
    """A sample's per-response-token weight versions, or None when it has none."""
    r = int(sample.response_length)
    per_token = list(getattr(sample, "weight_versions", None) or [])
    if per_token:
        if len(per_token) == len(sample.tokens):
            per_token = per_token[len(per_token) - r :]
        if len(per_token) != r:
            raise ValueError(
                f"sample ({label}): weight_versions has {len(per_token)} entries; it needs one "
                f"per response token ({r}) or one per token ({len(sample.tokens)})"
            )
        return per_token
    one = getattr(sample, "weight_version", None)
    if one is None:
        return None
    return [str(one) if m else None for m in sample.loss_mask]


@dataclass(slots=True)
class MicroBatch:
    """The model input of a few samples, and their response tokens as ``[B, R]`` rows.

    B = samples, R = the longest response. Padded layout: ``input_ids_BL`` is ``[B, L]``
    (L = the longest sequence, right-padded with 0) and ``position_ids_BL`` is None. Packed
    layout: ``input_ids_BL`` is ``[1, S]``, the samples back to back (S = their total length),
    and ``position_ids_BL`` restarts at 0 for each sample, which tells the model where the
    samples start (HF attention keeps each sample to itself).

    Attributes:
        indices: the samples' indices in the `TrainBatch`.
        response_lengths: the samples' response lengths.
        input_ids_BL: token ids (padded with 0 in the padded layout; padding sits after every
            real token, so a causal model's outputs at real positions do not see it).
        position_ids_BL: per-sample positions (packed layout) or None (padded).
        logit_pos_BR: for each response token, the flat index into the model's
            ``logits.reshape(-1, V)`` of the position that predicts it; padding points at 0.
        targets_BR: the response token ids (0 in padding).
        mask_BR: the loss mask (False in padding).
        rollout_logp_BR: rollout logprobs (0 in padding).
        advantages_BR: advantages (0 in padding; zeros until the trainer fills them).
        routed_BLNK: R3: for each position of ``input_ids_BL``, the rollout's experts per layer
            ``[B or 1, L, num_layers, top_k]`` int32, -1 where there is no record (padding, a
            sample's last token, samples without a record); None when the batch has none.
    """

    indices: list[int]
    response_lengths: list[int]
    input_ids_BL: torch.Tensor
    position_ids_BL: torch.Tensor | None
    logit_pos_BR: torch.Tensor
    targets_BR: torch.Tensor
    mask_BR: torch.Tensor
    rollout_logp_BR: torch.Tensor
    advantages_BR: torch.Tensor
    routed_BLNK: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """Whether the samples are packed into one row."""
        return self.position_ids_BL is not None

    def unpad(self, x_BR: torch.Tensor) -> list[list[float]]:
        """Per sample, the first ``response_length`` values of a ``[B, R]`` tensor."""
        rows: list[list[float]] = x_BR.detach().float().cpu().tolist()
        return [row[:r] for row, r in zip(rows, self.response_lengths)]

    def per_token(self, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        """``[B, R]`` float32 of per-sample lists indexed by batch sample (0 in padding)."""
        out = torch.zeros(self.mask_BR.shape, dtype=torch.float32)
        for b, (i, r) in enumerate(zip(self.indices, self.response_lengths)):
            if r:
                out[b, :r] = torch.tensor(rows[i], dtype=torch.float32)
        return out.to(self.mask_BR.device)


def make_micro_batch(
    batch: TrainBatch, indices: Sequence[int], device: torch.device, *, packed: bool = False
) -> MicroBatch:
    """Lay out the samples ``indices`` of ``batch`` as one `MicroBatch` on ``device``.

    ``advantages_BR`` holds ``batch.advantages`` when the batch has them, else zeros.
    """
    assert indices, "a micro-batch needs at least one sample"
    B = len(indices)
    lengths = [len(batch.tokens[i]) for i in indices]
    L = sum(lengths) if packed else max(lengths)
    R = max(batch.response_lengths[i] for i in indices)
    input_ids = torch.zeros(1 if packed else B, L, dtype=torch.long)
    positions = torch.zeros(1, L, dtype=torch.long) if packed else None
    logit_pos = torch.zeros(B, R, dtype=torch.long)
    targets = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R, dtype=torch.bool)
    rollout = torch.zeros(B, R, dtype=torch.float32)
    adv = torch.zeros(B, R, dtype=torch.float32)
    routed = _routed_layout(batch, indices, input_ids.shape, packed=packed)
    offset = 0
    for b, i in enumerate(indices):
        toks, r = batch.tokens[i], batch.response_lengths[i]
        row = torch.tensor(toks, dtype=torch.long)
        if packed:
            assert positions is not None
            input_ids[0, offset : offset + len(toks)] = row
            positions[0, offset : offset + len(toks)] = torch.arange(len(toks))
            base = offset
            offset += len(toks)
        else:
            input_ids[b, : len(toks)] = row
            base = b * L
        if r == 0:
            continue
        start = len(toks) - r
        logit_pos[b, :r] = torch.arange(base + start - 1, base + start - 1 + r)
        targets[b, :r] = row[start:]
        mask[b, :r] = torch.tensor(batch.loss_masks[i], dtype=torch.bool)
        rollout[b, :r] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        if batch.advantages is not None:
            adv[b, :r] = torch.tensor(batch.advantages[i], dtype=torch.float32)
    return MicroBatch(
        indices=list(indices),
        response_lengths=[batch.response_lengths[i] for i in indices],
        input_ids_BL=input_ids.to(device),
        position_ids_BL=None if positions is None else positions.to(device),
        logit_pos_BR=logit_pos.to(device),
        targets_BR=targets.to(device),
        mask_BR=mask.to(device),
        rollout_logp_BR=rollout.to(device),
        advantages_BR=adv.to(device),
        routed_BLNK=None if routed is None else routed.to(device),
    )


def _routed_layout(
    batch: TrainBatch, indices: Sequence[int], shape: torch.Size, *, packed: bool
) -> torch.Tensor | None:
    """The samples' routed experts laid out like ``input_ids_BL`` (-1 where not recorded)."""
    if batch.routed_experts is None:
        return None
    rows = [batch.routed_experts[i] for i in indices]
    known = next((r for r in batch.routed_experts if r is not None), None)
    if known is None:
        return None
    out = torch.full((*shape, *known.shape[1:]), -1, dtype=torch.int32)
    offset = 0
    for b, (i, r) in enumerate(zip(indices, rows)):
        n = len(batch.tokens[i])
        if r is not None:
            k = min(r.shape[0], n)
            if packed:
                out[0, offset : offset + k] = r[:k]
            else:
                out[b, :k] = r[:k]
        offset += n
    return out


def plan_micro_batches(
    lengths: Sequence[int],
    share: Sequence[int],
    *,
    micro_batch_size: int,
    max_tokens: int | None = None,
    packed: bool = False,
) -> list[list[int]]:
    """Cut one rank's samples ``share`` (in order) into micro-batches.

    Without ``max_tokens``: runs of ``micro_batch_size`` samples. With it: samples are added
    while the micro-batch's token count stays within ``max_tokens``; the count is the sum of
    the sample lengths when ``packed``, else samples x the longest (the padded size). A sample
    longer than the budget goes alone.

    Args:
        lengths: token count of every sample of the batch (indexed by sample).
        share: the sample indices to cut.
        micro_batch_size: samples per micro-batch without a token budget.
        max_tokens: the token budget, or None.
        packed: count tokens as packed (sum) rather than padded (count x max).

    Returns:
        Lists of sample indices, in order.
    """
    if max_tokens is None:
        return [
            list(share[j : j + micro_batch_size]) for j in range(0, len(share), micro_batch_size)
        ]
    out: list[list[int]] = []
    cur: list[int] = []
    total = longest = 0
    for i in share:
        n = lengths[i]
        cost = total + n if packed else (len(cur) + 1) * max(longest, n)
        if cur and cost > max_tokens:
            out.append(cur)
            cur, total, longest = [], 0, 0
        cur.append(i)
        total += n
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out
