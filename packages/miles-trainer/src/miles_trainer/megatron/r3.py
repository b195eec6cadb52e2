"""R3 (rollout routing replay) for megatron-core's MoE routers (see ``miles_trainer/r3.py``).

megatron-core's top-k routing asks ``router.router_replay.get_replay_topk`` for the experts
when the router has one (its own `RouterReplay` is a process-global list; the trainer sets its
own object per router instead, shared with the reference model's routers). The record of a
micro-batch is laid out in the router's token order: the model input is ``[B, L]`` padded to
the step's shape, the router sees ``[L, B]`` flattened (sequence first), and with sequence
parallelism each tensor-parallel rank routes only its slice of the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from miles_trainer.batch import MicroBatch, TrainBatch
from miles_trainer.r3 import RoutingReplay

__all__ = ["MegatronRouting"]


class _RouterHook:
    """What megatron-core's ``topk_routing_with_score_function`` calls as ``router_replay``."""

    def __init__(self, replay: RoutingReplay, layer: int) -> None:
        self.replay = replay
        self.layer = layer

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        idx = self.replay.choose(self.layer, own)
        if idx is own:
            return values, own
        # The scores of the replayed experts: megatron then softmaxes them (renormalised
        # top-k) or uses them as they are (pre-softmax), exactly as for its own choice.
        return scores.gather(1, idx), idx


class MegatronRouting:
    """The Megatron trainer's R3 state: patched routers, the record of each micro-batch, and
    the agreement metrics of the training forwards. For a dense model (``replay`` None) every
    method does nothing.

    Args:
        replay: the shared state of the patched routers, or None (dense model).
        tp: tensor-parallel size; tp_rank: this rank's; sequence_parallel: whether the
            sequence is split over the TP ranks before the MoE layers.
    """

    def __init__(
        self,
        replay: RoutingReplay | None,
        *,
        tp: int,
        tp_rank: int,
        sequence_parallel: bool,
    ) -> None:
        self.replay = replay
        self._tp, self._tp_rank, self._sp = tp, tp_rank, sequence_parallel
        self._counting = False

    @classmethod
    def build(
        cls,
        config: Any,
        hf_config: Any,
        modules: Iterable[torch.nn.Module | None],
        *,
        tp_rank: int,
    ) -> MegatronRouting:
        """Patch the routers of ``modules`` (None entries skipped); inactive for a dense model.

        Raises:
            ValueError: ``config.r3`` on a dense model.
        """
        from megatron.core.transformer.moe.router import TopKRouter

        mcfg = config.megatron
        experts = getattr(hf_config, "num_experts", None)
        if not experts:
            if config.r3:
                raise ValueError(
                    f"trainer.r3 needs an MoE model; {config.model_path} is "
                    f"{getattr(hf_config, 'model_type', '?')!r}: set trainer.r3: false"
                )
            return cls(None, tp=mcfg.tp, tp_rank=tp_rank, sequence_parallel=False)
        replay = RoutingReplay(
            replay=config.r3,
            num_layers=int(hf_config.num_hidden_layers),
            top_k=int(hf_config.num_experts_per_tok),
            num_experts=int(experts),
        )
        for module in modules:
            if module is None:
                continue
            for m in module.modules():
                if isinstance(m, TopKRouter):
                    assert m.layer_number is not None, "router without its layer number"
                    m.router_replay = _RouterHook(replay, int(m.layer_number) - 1)
        return cls(replay, tp=mcfg.tp, tp_rank=tp_rank, sequence_parallel=mcfg.sequence_parallel)

    def check(self, batch: TrainBatch) -> None:
        """`RoutingReplay.check`: refuse records that do not fit (or none when replaying)."""
        if self.replay is not None:
            self.replay.check(batch)

    def order(self, routed_BLNK: torch.Tensor | None, shape: tuple[int, ...]) -> Any:
        """The micro-batch record in this rank's router order for a model input of ``shape``
        (``[B2, L2]``, padded at the end of each dim): ``[L2, B2]`` flattened, this rank's
        sequence slice under sequence parallelism."""
        if routed_BLNK is None:
            return None
        B, L, N, K = routed_BLNK.shape
        B2, L2 = shape
        rec = torch.full((L2, B2, N, K), -1, dtype=routed_BLNK.dtype, device=routed_BLNK.device)
        rec[:L, :B] = routed_BLNK.transpose(0, 1)
        if self._sp and self._tp > 1:
            part = L2 // self._tp
            rec = rec[self._tp_rank * part : (self._tp_rank + 1) * part]
        return rec.reshape(-1, N, K)

    @contextlib.contextmanager
    def forward(self, mb: MicroBatch, shape: tuple[int, ...], *, real: bool) -> Iterator[None]:
        """Route the model call inside by ``mb``'s record (counted in a training pass when
        ``real``)."""
        if self.replay is None:
            yield
            return
        with self.replay.record(self.order(mb.routed_BLNK, shape), count=real and self._counting):
            yield

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the routing agreement of the forwards inside (the training passes)."""
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def metrics(self, device: torch.device) -> dict[str, float]:
        """``r3_router_agreement`` / ``r3_expert_match`` over every rank (collective).

        Tensor-parallel ranks without sequence parallelism count the same tokens, and
        pipeline stages different layers; the ratios are unchanged by such repeats.
        """
        return {} if self.replay is None else self.replay.metrics(device)
