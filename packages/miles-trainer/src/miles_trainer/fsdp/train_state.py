"""The FSDP2 backend's training state in a checkpoint (``<checkpoint>/fsdp/``).

The policy and the critic, each with its optimizer, go through torch.distributed.checkpoint
(DCP): every rank writes its own shards (DTensor local shards with several ranks, full tensors
with one) and reads them back in place, bit for bit. Keys: ``model``, ``optimizer``,
``critic``, ``critic_optimizer`` (HF parameter names inside; the optimizer state in torch
AdamW's format keyed by parameter name, whatever `OffloadConfig` holds it).

An optimizer that has not stepped yet is not written (reading its state would initialise it
with a zero-lr step: the saved run would then differ from one that never saved).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

__all__ = ["SUBDIR", "load_state", "read_model_state", "save_state", "state_meta"]

SUBDIR = "fsdp"

# name -> (module, optimizer): "model" (the policy) and "critic" when there is one.
Parts = Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


def _optimizer_key(name: str) -> str:
    return "optimizer" if name == "model" else f"{name}_optimizer"


def state_meta(parts: Parts) -> dict[str, Any]:
    """What `save_state` writes, for ``meta.json``: the parts, which optimizers have state,
    and the tied parameter names left out of an HF export (``save_pretrained`` writes them
    once)."""
    model = parts["model"][0]
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    first = {n for n, _ in model.named_parameters()}
    return {
        "parts": sorted(parts),
        "optimizer_state": sorted(n for n, (_, opt) in parts.items() if opt.state),
        "hf_skip": sorted(all_names - first),
    }


def save_state(dst: Path, parts: Parts) -> None:
    """Write every part (and its optimizer, once it has state) under ``dst``. Collective."""
    state: dict[str, Any] = {}
    for name, (module, optimizer) in parts.items():
        state[name] = get_model_state_dict(module)
        if optimizer.state:
            state[_optimizer_key(name)] = get_optimizer_state_dict(module, optimizer)
    save(state, checkpoint_id=dst)


def load_state(src: Path, parts: Parts, meta: Mapping[str, Any]) -> None:
    """Read the parts back in place (the same parts and world size as at save). Collective."""
    state: dict[str, Any] = {}
    with_optimizer = set(meta["optimizer_state"])
    for name, (module, optimizer) in parts.items():
        state[name] = get_model_state_dict(module)
        if name in with_optimizer:
            # A template of the right structure (a fresh optimizer gets a zero-lr step first).
            state[_optimizer_key(name)] = get_optimizer_state_dict(module, optimizer)
    load(state, checkpoint_id=src)
    for name, (module, optimizer) in parts.items():
        set_model_state_dict(module, state[name])
        if name in with_optimizer:
            set_optimizer_state_dict(module, optimizer, _clone_tensors(state[_optimizer_key(name)]))


def read_model_state(ckpt: Path, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's full tensors (HF names, tied duplicates left out) in one process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    src = ckpt / SUBDIR
    md = FileSystemReader(src).read_metadata()
    prefix = "model."
    model: dict[str, torch.Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            model[key[len(prefix) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        load({"model": model}, checkpoint_id=src, no_dist=True)
    skip = set(meta.get("hf_skip", []))
    return {k: v for k, v in model.items() if k not in skip}


def _clone_tensors(tree: Any) -> Any:
    """A copy of nested dicts/lists with every tensor cloned (the optimizer must not adopt the
    loaded buffers)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone_tensors(v) for v in tree)
    return tree
