"""The Megatron backend's training state in a checkpoint (``<checkpoint>/megatron/``).

Every rank writes ``model_rank<r>.pt`` (its layout coordinates and its parameters under
Megatron names: its TP / PP / EP shards) and, once the optimizer has stepped,
``optim_rank<r>.pt``: per optimizer of megatron-core's (chained) optimizer its ``state_dict()``
(hyperparameters, step, fp32 masters of the non-distributed fp16/bf16 optimizer) and, for the
distributed optimizer, this data-parallel rank's fp32 master and Adam-moment shards
(``get_parameter_state_dp_reshardable``). A rank reads back exactly its own files, so a
checkpoint loads into the same layout only. `read_model_state` joins the model files of one
data-parallel replica into HF tensors (``convert.megatron_to_hf``) for `export_hf`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_trainer.megatron import cpu_compat
from miles_trainer.megatron.convert import (
    ModelDims,
    Parallel,
    megatron_to_hf,
    rank_rules,
    te_name,
)

__all__ = ["SUBDIR", "has_state", "load_rank", "read_model_state", "save_rank"]

SUBDIR = "megatron"


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def has_state(optimizer: Any) -> bool:
    """Whether the optimizer has stepped (megatron's distributed optimizer cannot describe its
    state before that)."""
    return any(len(opt.optimizer.state) > 0 for opt in _optimizers(optimizer))


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone().cpu()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return tree


def save_rank(
    dst: Path,
    *,
    rank: int,
    dp_rank: int,
    layout: Parallel,
    module: torch.nn.Module,
    optimizer: Any,
    with_optimizer: bool,
) -> None:
    """Write this rank's model (and optimizer) files under ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    model = {n: p.detach().clone().cpu() for n, p in module.named_parameters()}
    record = {"layout": dataclasses.asdict(layout), "dp_rank": dp_rank, "model": model}
    torch.save(record, dst / f"model_rank{rank:05d}.pt")
    if not with_optimizer:
        return
    entries = []
    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron():
        for opt in _optimizers(optimizer):
            entry = {"state_dict": _clone(opt.state_dict())}
            if hasattr(opt, "get_parameter_state_dp_reshardable"):
                entry["param_state"] = _clone(opt.get_parameter_state_dp_reshardable())
            entries.append(entry)
    torch.save(entries, dst / f"optim_rank{rank:05d}.pt")


def load_rank(
    src: Path,
    *,
    rank: int,
    layout: Parallel,
    module: torch.nn.Module,
    optimizer: Any,
    with_optimizer: bool,
) -> None:
    """Read this rank's files back into ``module`` and ``optimizer`` (same layout).

    Raises:
        ValueError: the file of this rank holds another layout position.
    """
    record = torch.load(src / f"model_rank{rank:05d}.pt", weights_only=False)
    if record["layout"] != dataclasses.asdict(layout):
        raise ValueError(
            f"{src}: rank {rank}'s file holds layout position {record['layout']}, this rank is "
            f"{dataclasses.asdict(layout)}: resume with the same layout and rank order"
        )
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(record["model"][n])
    if not with_optimizer:
        return
    entries = torch.load(src / f"optim_rank{rank:05d}.pt", weights_only=False)
    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron(), torch.no_grad():
        for opt, entry in zip(_optimizers(optimizer), entries, strict=True):
            opt.load_state_dict(entry["state_dict"])
            if "param_state" in entry:
                state = entry["param_state"]
                for dtypes in (v for k, v in state.items() if isinstance(k, int)):
                    for buckets in dtypes.values():
                        for bucket in buckets:
                            for param in bucket:
                                param.setdefault("padding", False)
                opt.load_parameter_state_from_dp_reshardable(state)
            # megatron's load gives every parameter the same step tensor; torch's AdamW
            # increments each parameter's step in place, so they must not share one.
            for s in opt.optimizer.state.values():
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"] = s["step"].clone()


def read_model_state(ckpt: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The full HF tensors of the policy from the model files of data-parallel replica 0."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(ckpt / "hf")
    lay = meta["layout"]
    dims = ModelDims.from_hf_config(
        hf_config, vocab_multiple=int(lay["make_vocab_size_divisible_by"]) * int(lay["tp"])
    )
    te = lay["transformer_impl"] == "transformer_engine"
    moe = bool(dims.num_experts)
    shards: dict[Parallel, dict[str, torch.Tensor]] = {}
    for f in sorted((ckpt / SUBDIR).glob("model_rank*.pt")):
        record = torch.load(f, weights_only=False, mmap=True)
        if record["dp_rank"] != 0:
            continue
        par = Parallel(**record["layout"])
        if par in shards:
            continue
        model = record["model"]
        shards[par] = {
            r.local: model[te_name(r.local, moe=moe) if te else r.local]
            for r in rank_rules(dims, par)
        }
    return megatron_to_hf(shards, dims)
