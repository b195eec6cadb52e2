"""The PyTorch reference quantizers: the precision contract (docs/contract.md) as tensor ops.

Each function takes the canonical view the API builds ([B, R, C] or [rows, C], contiguous, one
of fp32/bf16/fp16) and returns the outputs in the layout the native kernels write (see
native/quant/include/miles_quant/kernel_args.h). Scales and elements are computed on integer
bits (miles_quant._bits); the only float operations are the fp32 divisions and multiplications
the contract names, in its order, which torch performs with IEEE round-to-nearest-even (this
assumes torch.set_flush_denormal(False), the default).

Works on any device (the reference is also the CUDA fallback).
"""

from __future__ import annotations

import torch

from miles_quant import _bits
from miles_quant._bits import F32_INF_BITS, F32_QUIET_NAN
from miles_quant._spec import (
    AMAX_MIN,
    E2M1,
    E4M3,
    INT4_QMAX,
    INT4_SCALE_MIN,
    NVFP4_BLOCK_SCALE_MIN,
    NVFP4_GLOBAL_DIVISOR,
    Element,
)


def _pad(x: torch.Tensor, rows_to: int, cols_to: int) -> torch.Tensor:
    """Zero-pads the last two dims of x up to multiples (zeros change no amax and encode to 0)."""
    r, c = x.shape[-2], x.shape[-1]
    pr, pc = (-r) % rows_to, (-c) % cols_to
    if pr == 0 and pc == 0:
        return x
    return torch.nn.functional.pad(x, (0, pc, 0, pr))


def _tile_amax_bits(xf: torch.Tensor, tr: int, tc: int) -> torch.Tensor:
    """amax bits (int64) of each tr x tc tile of a zero-padded [B, R, C] fp32 tensor."""
    b, r, c = xf.shape
    ab = _bits.abs_bits(xf).view(b, r // tr, tr, c // tc, tc)
    return ab.amax(dim=(2, 4))


def _matrix_amax_bits(xf: torch.Tensor) -> torch.Tensor:
    """amax bits (int64) of each matrix of [B, R, C]; an empty matrix has amax 0."""
    b = xf.shape[0]
    if xf.numel() == 0:
        return torch.zeros(b, dtype=torch.int64, device=xf.device)
    return _bits.abs_bits(xf).reshape(b, xf[0].numel()).amax(dim=1)


def _expand(t: torch.Tensor, tr: int, tc: int) -> torch.Tensor:
    """[B, nR, nC] per-tile values -> [B, nR * tr, nC * tc] per element."""
    return t.repeat_interleave(tr, dim=1).repeat_interleave(tc, dim=2)


def _amax_min(device: torch.device) -> torch.Tensor:
    return torch.tensor(AMAX_MIN, dtype=torch.float32, device=device)


def _nan_f32(like: torch.Tensor) -> torch.Tensor:
    return _bits.bits_f32(torch.full_like(like, F32_QUIET_NAN, dtype=torch.int64))


_CANONICAL_NAN = {torch.float32: F32_QUIET_NAN, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def _nan_of(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The canonical quiet NaN of a float dtype, built from its bits (torch's own casts of NaN
    to bf16 do not all give the same bits)."""
    bits = _CANONICAL_NAN[dtype]
    if dtype == torch.float32:
        return _bits.bits_f32(torch.tensor(bits, dtype=torch.int64, device=device))
    return torch.tensor(bits, dtype=torch.int16, device=device).view(dtype)


def fp8(
    x: torch.Tensor, el: Element, tile: tuple[int, int], per_matrix: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with fp32 scales on x [B, R, C].

    Returns codes uint8 [B, R, C] and scales fp32 [B] (per_matrix) or [B, nR, nC] (tiles).
    s = max(amax, 1e-10) / max_elem; code = encode(x / s); a non-finite amax gives s = NaN and
    NaN codes.
    """
    b, r, c = x.shape
    if per_matrix:
        tr, tc = max(r, 1), max(c, 1)
        xf = x.to(torch.float32)
        amax = _matrix_amax_bits(xf).view(b, 1, 1)
    else:
        tr, tc = tile
        xf = _pad(x.to(torch.float32), tr, tc)
        amax = _tile_amax_bits(xf, tr, tc)
    poisoned = amax >= F32_INF_BITS
    s = _bits.div(torch.maximum(_bits.bits_f32(amax), _amax_min(x.device)), el.max_value)
    s_el = _expand(s, tr, tc)[:, : xf.shape[1], : xf.shape[2]]
    codes = _bits.encode(xf / s_el, el)
    p_el = _expand(poisoned, tr, tc)[:, : xf.shape[1], : xf.shape[2]]
    codes = torch.where(p_el, el.nan_code, codes).to(torch.uint8)
    scales = torch.where(poisoned, _nan_f32(s), s)
    codes = codes[:, :r, :c].contiguous()
    return codes, (scales.reshape(b) if per_matrix else scales)


def mx(x: torch.Tensor, el: Element, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MX on x [rows, C]: 1x32 blocks, E8M0 scale codes by `rule`, elements RNE-saturated.

    Returns data uint8 [rows, C] (FP8 elements) or packed [rows, ceil(C/2)] (E2M1) and scale
    codes uint8 [rows, ceil(C/32)].
    """
    c = x.shape[1]
    xf = _pad(x.to(torch.float32).unsqueeze(0), 1, 32)
    amax = _tile_amax_bits(xf, 1, 32)  # [1, rows, nb]
    poisoned = amax >= F32_INF_BITS
    code = torch.where(poisoned, _bits.E8M0_NAN, _bits.e8m0_code(amax, el, rule))
    m = _bits.e8m0_inverse(torch.where(poisoned, 127, code))
    codes = _bits.encode(xf * _expand(m, 1, 32), el)
    codes = torch.where(_expand(poisoned, 1, 32), el.nan_code, codes).to(torch.uint8)[0]
    if el.torch_dtype is None:
        data = _pack(codes)[:, : (c + 1) // 2]
    else:
        data = codes[:, :c]
    return data.contiguous(), code[0].to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Packs an even number of nibble codes along the last dim, element 0 low."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def nvfp4(
    x: torch.Tensor, tile16x16: bool, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 on x [B, R, C]: E2M1 elements, E4M3 block scales, fp32 global scale per matrix.

    Returns packed data uint8 [B, R, ceil(C/2)], block scale codes uint8 [B, R, ceil(C/16)]
    (a 16x16 tile's code repeated on its rows) and global scales fp32 [B].
    s_g = max(amax, 1e-10) / 2688, or `global_scale` [B] when given (then a block holding NaN or
    Inf is poisoned alone, not its matrix); block code = e4m3(clamp((amax_b / 6) / s_g, 2^-6,
    448)); elements e2m1(x * ((1 / s_g) / block scale)).
    """
    b, r, c = x.shape
    tr = 16 if tile16x16 else 1
    xf0 = x.to(torch.float32)
    if global_scale is None:
        gamax = _matrix_amax_bits(xf0)
        gpoison = gamax >= F32_INF_BITS
        sg = _bits.div(
            torch.maximum(_bits.bits_f32(gamax), _amax_min(x.device)), NVFP4_GLOBAL_DIVISOR
        )
    else:
        sg = global_scale.to(device=x.device, dtype=torch.float32).reshape(b)
        gpoison = torch.zeros(b, dtype=torch.bool, device=x.device)
    inv = torch.ones_like(sg) / sg
    xf = _pad(xf0, tr, 16)
    amax = _tile_amax_bits(xf, tr, 16)  # [B, nR, nC]
    bs = _bits.div(_bits.bits_f32(amax), E2M1.max_value) / sg.view(b, 1, 1)
    bs = torch.clamp(bs, min=NVFP4_BLOCK_SCALE_MIN, max=E4M3.max_value)
    code = _bits.encode(bs, E4M3)
    factor = inv.view(b, 1, 1) / _bits.decode(code, E4M3)
    codes = _bits.encode(xf * _expand(factor, tr, 16), E2M1)
    # Poisoned: the matrix (computed scale), or a block alone (given scale: gpoison all False).
    gp = gpoison.view(b, 1, 1) | (amax >= F32_INF_BITS)
    codes = torch.where(_expand(gp, tr, 16), 0, codes).to(torch.uint8)
    code = torch.where(gp, E4M3.nan_code, code).to(torch.uint8)
    data = _pack(codes)[:, :r, : (c + 1) // 2].contiguous()
    scales = code.repeat_interleave(tr, dim=1)[:, :r].contiguous()
    gscale = torch.where(gpoison, _nan_f32(sg), sg)
    return data, scales, gscale


def int4(
    x: torch.Tensor, group: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 on x [rows, C] in groups along C.

    Returns packed offset-binary codes uint8 [rows, ceil(C/2)] (q + 8, element 0 low, an odd
    tail padded with 8) and scales [rows, ceil(C/group)] in scale_dtype.
    s = max(amax / 7, 1e-5) rounded to scale_dtype (float16 saturating at 65504);
    q = clamp(rne(clamp(x / s, -8, 8)), -7, 7).
    """
    c = x.shape[1]
    xf = _pad(x.to(torch.float32).unsqueeze(0), 1, group)
    amax = _tile_amax_bits(xf, 1, group)
    poisoned = amax >= F32_INF_BITS
    s = torch.clamp(_bits.div(_bits.bits_f32(amax), INT4_QMAX), min=INT4_SCALE_MIN)
    if scale_dtype == torch.float16:  # saturate, as the native fp32 -> fp16 conversion does
        s = torch.clamp(s, max=65504.0)
    s_store = torch.where(poisoned, _nan_of(scale_dtype, x.device), s.to(scale_dtype))
    sf = s_store.to(torch.float32)
    y = torch.clamp(xf / _expand(sf, 1, group), -8.0, 8.0)
    q = torch.clamp(torch.round(y), -7, 7).to(torch.int64) + 8
    # Zero padding quantizes to q = 0 (code 8), so an odd row ends with the nibble 8.
    q = torch.where(_expand(poisoned, 1, group), 8, q).to(torch.uint8)[0]
    data = _pack(q)[:, : (c + 1) // 2].contiguous()
    return data, s_store[0].contiguous()


def encode(x: torch.Tensor, el: Element) -> torch.Tensor:
    """Raw element cast of fp32 values (see _bits.encode)."""
    return _bits.encode(x, el)
