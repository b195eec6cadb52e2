"""Checkpoint directories for the disk-delta tests: a base and a plausibly trained successor."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_transfer.checkpoint import save_safetensors


def write_checkpoint(
    path: Path,
    tensors: dict[str, torch.Tensor],
    *,
    config: str = '{"model_type": "toy"}',
    shards: int = 1,
) -> Path:
    """An HF-style directory: ``config.json`` plus ``shards`` safetensors files."""
    path.mkdir(parents=True, exist_ok=True)
    items = list(tensors.items())
    for i in range(shards):
        part = items[i::shards]
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}"
        save_safetensors(part, path / (name if shards == 1 else name + ".safetensors"))
    (path / "config.json").write_text(config)
    return path


def base_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A toy policy in rollout precision, with a few odd dtypes and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(64, generator=g),  # fp32
        "fp8.weight": torch.randn(32, 32, generator=g).to(torch.float8_e4m3fn),
        "rotary.inv_freq": torch.arange(16, dtype=torch.int64),
        "mask": torch.rand(40, generator=g) > 0.5,
        "empty": torch.empty(0, 8, dtype=torch.bfloat16),
    }


def step(tensors: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """Change about ``frac`` of the float elements by a relative 1e-2 (an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            hit = torch.rand(t.shape, generator=g) < frac
            moved = (t.float() * 1.01 + 1e-3).to(t.dtype)
            it = ints[t.element_size()]
            t = torch.where(hit, moved.view(it), t.view(it)).view(t.dtype)
        out[name] = t.clone()
    return out


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` (hidden ones too) with its bytes: equal iff identical."""
    return {
        p.relative_to(path).as_posix(): p.read_bytes() if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


def same_files(a: Path, b: Path) -> bool:
    """The non-hidden files of two directories are identical, byte for byte."""
    names_a = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    names_b = sorted(p.name for p in b.iterdir() if not p.name.startswith("."))
    return names_a == names_b and all((a / n).read_bytes() == (b / n).read_bytes() for n in names_a)
