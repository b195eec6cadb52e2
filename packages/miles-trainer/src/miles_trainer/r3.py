"""R3 (rollout routing replay): MoE layers use the experts the rollout engine chose.

An MoE router picks each token's top-k experts from its own scores. The rollout engine made
that choice once, under its weights and kernels; the trainer's forward, under slightly
different numerics (or weights a few steps newer), can pick other experts for near-tied
tokens, and then computes a different function than the one that produced the sample. With
replay, each (token, layer) row that has a record uses the recorded expert ids; the gate
weights are still the router's own probabilities of those experts (softmax, renormalised
over the chosen ones when the model does), so gradients flow into the router as usual.

`RoutingReplay` holds the record of the current forward and the agreement counters; each
backend patches its routers to call `RoutingReplay.choose` (`install_hf` here for Hugging
Face Qwen3-MoE, ``megatron/r3.py`` for megatron-core's ``TopKRouter``) and lays the batch's
``routed_BLNK`` out in its router's token order.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_trainer.batch import TrainBatch

__all__ = ["RoutingReplay", "install_hf"]

# transformers' routers whose forward `_hf_router_forward` reproduces op for op
# (softmax in float32, top-k, optional renormalisation, cast to the logits' dtype).
_HF_ROUTERS = ("Qwen3MoeTopKRouter",)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutingReplay:
    """The routing record of the forward in progress, shared by one trainer's patched routers.

    Outside `record` every router routes by itself. Inside, the router of layer ``l`` reads
    row ``t`` of ``routed_TNK[:, l]`` for its token ``t`` (the backend's token order): a row of
    expert ids replaces the router's own top-k when ``replay`` is on; a row of -1 (no record:
    padding, a sample's last token) keeps the router's choice. With ``count``, the rows that
    have a record are counted: how many the router's own top-k matches as a set
    (``router_agreement``) and how many the experts actually used match (``expert_match``: 1.0
    with replay).

    Args:
        replay: use the recorded experts (``TrainerConfig.r3``); False only measures.
        num_layers: decoder layers of the model (rows of the record per token).
        top_k: experts per token.
        num_experts: routed experts per layer (ids must be below it).
    """

    def __init__(self, *, replay: bool, num_layers: int, top_k: int, num_experts: int) -> None:
        self.replay = replay
        self.num_layers = num_layers
        self.top_k = top_k
        self.num_experts = num_experts
        self._routed_TNK: torch.Tensor | None = None
        self._on: dict[torch.device, torch.Tensor] = {}
        self._count = False
        self._sums: list[torch.Tensor] = []  # (agree, match, rows) per counted router call

    def check(self, batch: TrainBatch) -> None:
        """Refuse a batch whose record does not fit the model, or none when replaying.

        Raises:
            ValueError: naming the sample and the fix.
        """
        rows = batch.routed_experts
        if self.replay:
            missing = [i for i in range(len(batch)) if rows is None or rows[i] is None]
            if missing:
                raise ValueError(
                    f"trainer.r3 is on but {batch.name(missing[0])} has no routed_experts "
                    f"({len(missing)} of {len(batch)} samples lack them): ask the rollout engine "
                    "for them (return_routed_experts) or set trainer.r3: false"
                )
        if rows is None:
            return
        for i, t in enumerate(rows):
            if t is None:
                continue
            if tuple(t.shape[1:]) != (self.num_layers, self.top_k):
                raise ValueError(
                    f"{batch.name(i)}: routed_experts has [num_layers, top_k] = "
                    f"{list(t.shape[1:])}, the model has [{self.num_layers}, {self.top_k}]: the "
                    "record comes from another model"
                )
            if t.numel() and int(t.max()) >= self.num_experts:
                raise ValueError(
                    f"{batch.name(i)}: routed_experts holds expert id {int(t.max())}, the model "
                    f"has {self.num_experts} experts per layer"
                )

    @contextlib.contextmanager
    def record(self, routed_TNK: torch.Tensor | None, *, count: bool) -> Iterator[None]:
        """Route the forward run inside by ``routed_TNK`` (``[tokens, layers, top_k]`` in the
        router's token order, -1 rows unrecorded; None: no record)."""
        assert self._routed_TNK is None, "routing records do not nest"
        self._routed_TNK = routed_TNK
        self._count = count and routed_TNK is not None
        try:
            yield
        finally:
            self._routed_TNK = None
            self._on.clear()
            self._count = False

    def choose(self, layer: int, own_TK: torch.Tensor) -> torch.Tensor:
        """The experts layer ``layer`` uses: the record where there is one (replay), else
        the router's own ``own_TK`` (returned as is: same object, same bits)."""
        if self._routed_TNK is None:
            return own_TK
        rec_TK = self._on.get(own_TK.device)
        if rec_TK is None:  # one copy per device per forward (a reference kept on the CPU)
            rec_TK = self._routed_TNK.to(own_TK.device, torch.int64)
            self._on[own_TK.device] = rec_TK
        rec_TK = rec_TK[:, layer]
        assert rec_TK.shape == own_TK.shape, (
            f"routing record {tuple(rec_TK.shape)} vs router {tuple(own_TK.shape)} (layer {layer})"
        )
        has_T = rec_TK[:, 0] >= 0
        used_TK = torch.where(has_T[:, None], rec_TK, own_TK) if self.replay else own_TK
        if self._count:
            with torch.no_grad():
                agree = _same_set(own_TK, rec_TK) & has_T
                match = _same_set(used_TK, rec_TK) & has_T
                self._sums.append(torch.stack([agree.sum(), match.sum(), has_T.sum()]).double())
        return used_TK

    def metrics(self, device: torch.device, group: Any = None) -> dict[str, float]:
        """The counted rows' ``r3_router_agreement`` and ``r3_expert_match`` summed over the
        ranks of ``group`` (collective there when it has several ranks); resets the counters.
        Empty when nothing was counted on any rank."""
        total = torch.zeros(3, dtype=torch.float64, device=device)
        for s in self._sums:
            total += s.to(device)
        self._sums = []
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        agree, match, rows = total.tolist()
        if rows == 0:
            return {}
        return {"r3_router_agreement": agree / rows, "r3_expert_match": match / rows}


def _same_set(a_TK: torch.Tensor, b_TK: torch.Tensor) -> torch.Tensor:
    """Per row, whether the two rows hold the same experts (in any order; ids are distinct)."""
    return (a_TK[:, :, None] == b_TK[:, None, :]).any(-1).all(-1)


def _hf_router_forward(
    self: Any, replay: RoutingReplay, layer: int, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' Qwen3MoeTopKRouter.forward with the experts chosen by ``replay``."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    top_value, own_idx = torch.topk(router_probs, self.top_k, dim=-1)
    idx = replay.choose(layer, own_idx)
    if idx is not own_idx:  # the router's probabilities of the replayed experts
        top_value = router_probs.gather(-1, idx)
    if self.norm_topk_prob:
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), idx


def install_hf(model: torch.nn.Module, replay: RoutingReplay) -> int:
    """Route ``model``'s MoE routers through ``replay``; return how many were patched.

    Only routers whose forward is reproduced exactly are patched (transformers' Qwen3-MoE);
    outside `RoutingReplay.record` they compute what they computed before, bit for bit.
    """
    count = 0
    for name, module in model.named_modules():
        if type(module).__name__ not in _HF_ROUTERS:
            continue
        m = _LAYER.search(name)
        assert m is not None, f"router {name} outside a decoder layer"
        forward = functools.partial(_hf_router_forward, module, replay, int(m.group(1)))
        module.forward = forward
        count += 1
    return count


def hf_moe_dims(config: Any) -> tuple[int, int, int] | None:
    """(num_layers, top_k, num_experts) of an HF MoE config, or None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return int(config.num_hidden_layers), int(top_k), int(experts)


def routed_hf_order(routed_BLNK: torch.Tensor | None) -> torch.Tensor | None:
    """A micro-batch's record in an HF router's token order (rows of ``input_ids_BL``
    flattened)."""
    if routed_BLNK is None:
        return None
    B, L, N, K = routed_BLNK.shape
    return routed_BLNK.reshape(B * L, N, K)
