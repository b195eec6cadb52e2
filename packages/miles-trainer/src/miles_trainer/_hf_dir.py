"""Hugging Face checkpoint directories: check one before loading, write one atomically.

Shared by every backend: each gathers full HF-named tensors its own way, then calls
`write_hf_dir`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["MAX_SHARD_BYTES", "TOKENIZER_FILES", "check_model_dir", "write_hf_dir"]

# Files copied from the source model directory when present (everything a tokenizer needs).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Hugging Face's default shard size for save_pretrained.
MAX_SHARD_BYTES = 5 * 1024**3


def check_model_dir(path: str, what: str = "model_path") -> Path:
    """Fail early, and clearly, if ``path`` is not a loadable HF safetensors directory.

    Raises:
        FileNotFoundError: no such directory, no config.json, or no safetensors weights.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{what} {path!r} is not a directory (a local HF model dir)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{what} {path!r} has no config.json")
    if not ((p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()):
        hint = ""
        if any(p.glob("pytorch_model*.bin")):
            hint = " (found pytorch_model*.bin: re-save it as safetensors with save_pretrained)"
        raise FileNotFoundError(
            f"{what} {path!r} has no model.safetensors or model.safetensors.index.json{hint}"
        )
    return p


def _shard(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_weights(tmp: Path, state: dict[str, torch.Tensor]) -> None:
    shards = _shard({k: v.contiguous() for k, v in state.items()})
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _fsync(tmp / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        _fsync(tmp / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_hf_dir(
    path: str | os.PathLike[str],
    state: dict[str, torch.Tensor],
    *,
    config: Any,
    generation_config: Any,
    source_dir: str,
    dtype: torch.dtype,
) -> Path:
    """Write an HF model directory atomically (temp dir in the same parent, then rename).

    Nothing is ever half-written at ``path``: on any error the temp dir is removed and an
    existing checkpoint at ``path`` is left as it was. An existing ``path`` is replaced (moved
    aside, the new one renamed in, the old one deleted).

    Args:
        path: the directory to create.
        state: full tensors, HF names.
        config: the model's ``PretrainedConfig`` (its ``dtype`` is set to ``dtype``).
        generation_config: a ``GenerationConfig`` or None; ``generation_config.json`` from
            ``source_dir`` is copied instead when present.
        source_dir: the model directory the trainer loaded; tokenizer files are copied from it.
        dtype: the dtype the weights are written in.

    Returns:
        The final path.
    """
    out = Path(path).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_weights(tmp, {k: v.to(dtype) for k, v in state.items()})
        cfg = copy.deepcopy(config)
        cfg.dtype = dtype
        cfg.save_pretrained(tmp)
        src = Path(source_dir)
        if (src / "generation_config.json").is_file():
            shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
        elif generation_config is not None:
            generation_config.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
