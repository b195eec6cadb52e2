"""Loading HF checkpoints and all-or-nothing weight updates by HF parameter name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["check_checkpoint_dir", "load_safetensors_dir", "param_table", "prepare_update"]

# Problems listed in one error message before "... and N more".
_MAX_LISTED = 8


def check_checkpoint_dir(path: str) -> Path:
    """Return ``path`` as a Path if it is an HF checkpoint directory, else raise ValueError."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"model_path {path!r} does not exist; pass a local HF checkpoint directory "
            "(one written by model.save_pretrained(dir))"
        )
    if not p.is_dir():
        raise ValueError(f"model_path {path!r} is not a directory; pass the checkpoint directory")
    if not (p / "config.json").is_file():
        raise ValueError(
            f"no config.json in {path!r}; this is not an HF checkpoint directory (write one with "
            "model.save_pretrained(dir))"
        )
    if not any(p.glob("*.safetensors")):
        raise ValueError(
            f"no *.safetensors weight files in {path!r}; save the model with "
            "model.save_pretrained(dir) (safetensors is its default format)"
        )
    _check_files(p)
    return p


def _check_files(p: Path) -> None:
    """config.json parses to an object and every safetensors header reads (cheap: no tensor
    data is loaded), so a corrupt file fails here, named, instead of deep inside a loader."""
    import json

    from safetensors import SafetensorError, safe_open

    config = p / "config.json"
    try:
        data = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{config} is not valid JSON ({exc}); the checkpoint is damaged: write it again "
            "with model.save_pretrained(dir) or copy it again"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{config} holds a JSON {type(data).__name__}, not the object of a model config; "
            "write the checkpoint again with model.save_pretrained(dir)"
        )
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"{f} is not a readable safetensors file ({exc}); it is truncated or corrupt: "
                "write the checkpoint again with model.save_pretrained(dir) or copy it again"
            ) from None


def load_safetensors_dir(path: str) -> list[tuple[str, torch.Tensor]]:
    """Read every tensor of every ``*.safetensors`` file in a checkpoint directory."""
    from safetensors.torch import load_file

    p = check_checkpoint_dir(path)
    out: list[tuple[str, torch.Tensor]] = []
    for f in sorted(p.glob("*.safetensors")):
        out.extend(load_file(str(f)).items())
    return out


def param_table(model: Any) -> dict[str, torch.Tensor]:
    """HF name -> parameter, tied names included (``lm_head.weight`` and the embedding), plus
    the checkpoint's per-expert names of fused MoE experts (views; see ``_moe.py``)."""
    from miles_rollout._moe import expert_aliases

    return {**dict(model.named_parameters(remove_duplicate=False)), **expert_aliases(model)}


def prepare_update(
    params: Mapping[str, torch.Tensor],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate a whole update and return ``(destination, source cast to dtype)`` pairs.

    Nothing is written here, so the caller can copy all pairs or none.

    Raises:
        ValueError: listing every unknown name, wrong shape and non-float dtype found.
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    unknown: list[str] = []
    problems: list[str] = []
    count = 0
    for item in named_tensors:
        count += 1
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        name, src = item
        if not isinstance(name, str) or not isinstance(src, torch.Tensor):
            raise ValueError(f"expected (str, torch.Tensor), got ({type(name).__name__}, ...)")
        dst = params.get(name)
        if dst is None:
            unknown.append(name)
            continue
        if tuple(src.shape) != tuple(dst.shape):
            problems.append(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            continue
        if not src.is_floating_point():
            problems.append(f"{name}: dtype {src.dtype} is not a floating-point dtype")
            continue
        pairs.append((dst, src.detach().to(device=dst.device, dtype=dtype)))
    if unknown:
        problems.insert(
            0,
            f"unknown parameter names {_listed(unknown)} (expected HF names such as "
            f"{_listed(sorted(params)[:3])})",
        )
    if problems:
        raise ValueError(
            f"weight update rejected, no weight was changed ({count} tensors): "
            + "; ".join(problems[:_MAX_LISTED])
            + (
                f"; ... and {len(problems) - _MAX_LISTED} more"
                if len(problems) > _MAX_LISTED
                else ""
            )
        )
    return pairs


def _listed(names: list[str]) -> str:
    shown = names[:_MAX_LISTED]
    more = f" ... and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return str(shown) + more
