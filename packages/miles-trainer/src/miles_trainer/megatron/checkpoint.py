"""Full HF-named tensors out of a Megatron layout (gathered over TP / EP / PP), HF checkpoints.

`iter_hf_tensors` is a collective generator: every rank of the job must run it to the end, in
the same order. Inside a pipeline stage the TP (and expert-TP) ranks all-gather their slices
and the expert-parallel ranks all-gather their experts; the stage then broadcasts each full
tensor to the other stages, so every rank yields every tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from miles_trainer.megatron.convert import ModelDims, Parallel, Rule, hf_shapes, rank_rules, unshard

__all__ = ["iter_hf_tensors"]

_PER_EXPERT = ".mlp.experts.local_experts."


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return parts


def _full(
    rule: Rule, local: Callable[[str], torch.Tensor], dims: ModelDims, par: Parallel
) -> dict[str, torch.Tensor]:
    """The full HF tensors of ``rule`` (a collective over the rule's TP or expert-TP group)."""
    t = local(rule.local).detach()
    if rule.group == "tp":
        parts = _all_gather(t, ps.get_tensor_model_parallel_group(), par.tp)
    elif rule.group == "etp":
        parts = _all_gather(t, ps.get_expert_tensor_parallel_group(), par.etp)
    else:
        parts = [t]
    return unshard(rule, parts, dims)


def _stage_tensors(
    local: Callable[[str], torch.Tensor], dims: ModelDims, par: Parallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's full HF tensors in `hf_names` order (collective within the stage)."""
    rules = rank_rules(dims, par)
    # Rules of the same rule index on EP rank k name expert k * E/ep + j instead of j.
    by_ep = [rank_rules(dims, replace(par, ep_rank=k)) for k in range(par.ep)]
    i = 0
    while i < len(rules):
        rule = rules[i]
        if _PER_EXPERT not in rule.local:
            if not rule.copy:
                yield from _full(rule, local, dims, par).items()
            i += 1
            continue
        j = i  # this layer's expert rules: i .. j-1
        while j < len(rules) and _PER_EXPERT in rules[j].local:
            j += 1
        group, size = ps.get_expert_model_parallel_group(), par.ep
        per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
        for idx in range(i, j):
            full = _full(rules[idx], local, dims, par)
            for name, t in full.items():
                which = rules[idx].hf.index(name)
                for k, part in enumerate(_all_gather(t, group, size)):
                    per_rank[k][by_ep[k][idx].hf[which]] = part
        for k in range(size):  # expert order: EP rank k holds the k-th block of experts
            yield from per_rank[k].items()
        i = j


def iter_hf_tensors(
    local: Callable[[str], torch.Tensor],
    dims: ModelDims,
    par: Parallel,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF tensor, on every rank. Collective.

    Args:
        local: this rank's Megatron tensor by (local-layer) name: a parameter, or its
            gradient.
        dims: the model.
        par: this rank's coordinates.
        dtype: the tensors' dtype (the receive buffers of other pipeline stages).
        device: where the receive buffers live.
    """
    shapes = hf_shapes(dims)
    group = ps.get_pipeline_model_parallel_group()
    stage_ranks = dist.get_process_group_ranks(group) if par.pp > 1 else [dist.get_rank()]
    for stage in range(par.pp):
        if stage == par.pp_rank:
            for name, t in _stage_tensors(local, dims, par):
                if par.pp > 1:
                    t = t.contiguous()
                    dist.broadcast(t, src=stage_ranks[stage], group=group)
                yield name, t
            continue
        # Another stage owns these: receive them in the order it sends them.
        for name in _stage_order(dims, replace(par, pp_rank=stage)):
            buf = torch.empty(shapes[name], dtype=dtype, device=device)
            dist.broadcast(buf, src=stage_ranks[stage], group=group)
            yield name, buf


def _stage_order(dims: ModelDims, par: Parallel) -> list[str]:
    """The HF names `_stage_tensors` yields for the stage of ``par``, in its order."""
    rules = rank_rules(dims, par)
    by_ep = [rank_rules(dims, replace(par, ep_rank=k)) for k in range(par.ep)]
    out: list[str] = []
    i = 0
    while i < len(rules):
        if _PER_EXPERT not in rules[i].local:
            if not rules[i].copy:
                out += rules[i].hf
            i += 1
            continue
        j = i
        while j < len(rules) and _PER_EXPERT in rules[j].local:
            j += 1
        for k in range(par.ep):
            for idx in range(i, j):
                out += by_ep[k][idx].hf
        i = j
    return out
