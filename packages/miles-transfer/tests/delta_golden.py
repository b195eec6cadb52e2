"""Deterministic checkpoints for the golden delta files in ``data/`` (no RNG: integer hashes).

``data/golden-{xor,overwrite}`` were written by miles-transfer's delta code before the native
kernels existed (commit fa5661e, PyTorch path) with ``write_golden`` below; the tests check that
today's code writes the same bytes and applies them.
"""

from __future__ import annotations

from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "data"
CHUNK_ELEMS = 1024


def _bits(n: int, salt: int) -> torch.Tensor:
    """n pseudo-random int64s from a multiplicative hash of the index (no RNG involved)."""
    x = torch.arange(n, dtype=torch.int64) * 2654435761 + salt * 40503
    x = x ^ (x >> 13)
    x = x * 1274126177
    return x ^ (x >> 16)


def checkpoints() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, new): bf16 / fp32 / fp8 / bool / int64 tensors of odd sizes; 2% to all changed."""
    base = {
        "w.bf16": (_bits(5000, 1) & 0x3FFF).to(torch.int16).view(torch.bfloat16).reshape(50, 100),
        "w.f32": (_bits(1500, 2) & 0x3FFFFFFF).to(torch.int32).view(torch.float32),
        "w.fp8": (_bits(2049, 3) & 0x7E).to(torch.uint8).view(torch.float8_e4m3fn),
        "mask": (_bits(100, 4) & 1).bool(),
        "ids": _bits(77, 5),
        "dense.bf16": (_bits(700, 6) & 0x3FFF).to(torch.int16).view(torch.bfloat16),
    }
    new = {k: v.clone() for k, v in base.items()}
    for salt, (name, every) in enumerate((("w.bf16", 50), ("w.f32", 37), ("w.fp8", 64))):
        flat = new[name].view(-1)
        ints = flat.view({2: torch.int16, 4: torch.int32, 1: torch.uint8}[flat.element_size()])
        ints[::every] ^= 1 + salt
    new["mask"][::3] = ~new["mask"][::3]
    new["ids"][-1] += 1
    new["dense.bf16"].view(torch.int16).add_(3)  # every element
    return base, new


def write_golden(out: Path) -> None:
    """Write base/new checkpoints and both encodings' deltas under ``out`` (the generator)."""
    from delta_testutil import write_checkpoint

    from miles_transfer.delta import encode_delta

    base, new = checkpoints()
    write_checkpoint(out / "base", base)
    write_checkpoint(out / "new", new)
    for encoding in ("xor", "overwrite"):
        encode_delta(
            out / "base",
            out / "new",
            out / f"golden-{encoding}",
            encoding=encoding,
            chunk_elems=CHUNK_ELEMS,
        )
