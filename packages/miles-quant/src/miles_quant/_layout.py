"""Packing of 4-bit codes and the swizzled 128x4 scale layout (docs/contract.md, "Layouts")."""

from __future__ import annotations

import math

import torch


def _check_last_dim(t: torch.Tensor, name: str) -> None:
    if t.dim() < 1:
        raise ValueError(f"{name}: expected a tensor with at least one dimension, got a scalar")


def pack_nibbles(codes: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """Packs 4-bit codes along the last dim, two per byte, element 0 in the low nibble.

    Args:
        codes: uint8 tensor [..., K] with values 0..15.
        pad: nibble written after the last code when K is odd (the code of zero).

    Returns:
        uint8 tensor [..., ceil(K / 2)].
    """
    _check_last_dim(codes, "pack_nibbles")
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_nibbles: codes must be uint8, got {codes.dtype}")
    k = codes.shape[-1]
    if k % 2:
        codes = torch.cat([codes, torch.full_like(codes[..., :1], pad)], dim=-1)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [..., ceil(k / 2)] -> uint8 codes [..., k]."""
    _check_last_dim(packed, "unpack_nibbles")
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_nibbles: packed must be uint8, got {packed.dtype}")
    if packed.shape[-1] != (k + 1) // 2:
        raise ValueError(
            f"unpack_nibbles: {packed.shape[-1]} bytes cannot hold {k} codes "
            f"(expected {(k + 1) // 2})"
        )
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    out = out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return out[..., :k]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Packs E2M1 codes (uint8 [..., K], 0..15) into bytes [..., ceil(K/2)], element 0 in the low
    nibble (torchao, HF gpt-oss, ModelOpt); an odd K is padded with the code of +0.

    Raises:
        ValueError: codes that are not uint8, or a code above 15 (it does not fit a nibble).
    """
    _check_last_dim(codes, "pack_fp4")
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4: codes must be uint8 E2M1 codes 0..15, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(
            f"pack_fp4: E2M1 codes must lie in [0, 15] (sign bit 8, magnitude 0..7), got "
            f"{int(codes.max())}; pass codes, not values (quantize(x, 'mxfp4') makes them)"
        )
    return pack_nibbles(codes, pad=0)


def unpack_fp4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Unpacks bytes [..., ceil(k/2)] into E2M1 codes uint8 [..., k]."""
    return unpack_nibbles(packed, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Packs signed 4-bit integers (any integer dtype, values -8..7) [..., K] into bytes
    [..., ceil(K/2)] as offset-binary nibbles (q + 8), element 0 in the low nibble; an odd K is
    padded with the code of 0 (8). Viewed as little-endian int32 this is compressed-tensors'
    pack-quantized layout."""
    _check_last_dim(q, "pack_int4")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"pack_int4: expected an integer tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    return pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8), pad=8)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Unpacks bytes [..., ceil(k/2)] into int8 values -8..7 [..., k]."""
    return unpack_nibbles(packed, k).to(torch.int8) - 8


# ---- swizzled scales (cuBLAS / TransformerEngine block-scaled GEMM layout) ---------------------


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded (rows, cols) of a swizzled scale matrix: rows to a multiple of 128, cols of 4."""
    return (rows + 127) // 128 * 128, (cols + 3) // 4 * 4


def swizzle_offsets(rows: int, cols: int) -> torch.Tensor:
    """Flat offset in the swizzled buffer of each scale (r, c) of a [rows, cols] matrix.

    The matrix is padded to [R, C] = swizzled_shape(rows, cols) and cut into 128x4 tiles stored
    row-tile-major; inside a tile, (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c.
    """
    if rows < 0 or cols < 0:
        raise ValueError(f"swizzle_offsets: rows and cols must be >= 0, got {rows} and {cols}")
    _, cp = swizzled_shape(rows, cols)
    r = torch.arange(rows, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(cols, dtype=torch.int64).unsqueeze(0)
    tile = (r // 128) * (cp // 4) + (c // 4)
    rr, cc = r % 128, c % 4
    return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Rearranges block scales [..., rows, cols] into the swizzled 128x4-tile layout.

    Works on any 1-byte scale dtype (E8M0 for MX, E4M3 for NVFP4). Padding scales are zero
    bytes (as torchao's to_blocked). Leading dims (stacked experts) are swizzled one matrix at
    a time.

    Returns:
        A tensor of the same dtype, shape [..., R, C] with (R, C) = swizzled_shape(rows, cols);
        its flat memory per matrix is the buffer cuBLAS/TE read.
    """
    if scales.dim() < 2:
        raise ValueError(
            f"swizzle_scales: expected [..., rows, cols], got shape {tuple(scales.shape)}"
        )
    if scales.element_size() != 1:
        raise ValueError(f"swizzle_scales: expected 1-byte scales, got {scales.dtype}")
    *lead, rows, cols = scales.shape
    rp, cp = swizzled_shape(rows, cols)
    n = math.prod(lead)
    src = scales.reshape(n, rows * cols).view(torch.uint8)
    out = torch.zeros(src.shape[0], rp * cp, dtype=torch.uint8, device=scales.device)
    idx = swizzle_offsets(rows, cols).reshape(-1).to(scales.device)
    out[:, idx] = src
    return out.view(scales.dtype).reshape(*lead, rp, cp)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales: [..., R, C] swizzled -> [..., rows, cols]."""
    if swizzled.dim() < 2:
        raise ValueError("unswizzle_scales: expected [..., R, C]")
    if swizzled.element_size() != 1:
        raise ValueError(f"unswizzle_scales: expected 1-byte scales, got {swizzled.dtype}")
    rp, cp = swizzled_shape(rows, cols)
    if tuple(swizzled.shape[-2:]) != (rp, cp):
        raise ValueError(
            f"unswizzle_scales: a [{rows}, {cols}] scale matrix swizzles to [{rp}, {cp}], "
            f"got {tuple(swizzled.shape[-2:])}"
        )
    lead = swizzled.shape[:-2]
    src = swizzled.reshape(math.prod(lead), rp * cp).view(torch.uint8)
    idx = swizzle_offsets(rows, cols).reshape(-1).to(swizzled.device)
    return src[:, idx].view(swizzled.dtype).reshape(*lead, rows, cols)
