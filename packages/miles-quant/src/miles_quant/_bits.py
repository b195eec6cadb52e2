"""Integer-bit building blocks of the PyTorch reference (docs/contract.md, "Element rounding").

Everything works on the fp32 bit patterns in int64 tensors, the way the C++ kernels do
(native/quant/include/miles_quant/{bits,elements}.h): no float log2, no float rounding tricks
whose result depends on the platform.
"""

from __future__ import annotations

import torch

from miles_quant._spec import Element

F32_ABS_MASK = 0x7FFFFFFF
F32_INF_BITS = 0x7F800000
F32_QUIET_NAN = 0x7FC00000
E8M0_NAN = 0xFF


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> its bit patterns as non-negative int64."""
    assert x.dtype == torch.float32
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def div(x: torch.Tensor, v: float) -> torch.Tensor:
    """x / v, correctly rounded on every device. PyTorch's CUDA true division by a Python number
    (a CPU scalar) computes x * (1 / v), which can be one ulp off x / v (an FP8 scale amax / 448
    on a GPU differed so from the CPU and the kernels); a divisor tensor on x's device takes the
    elementwise a / b path there. On CPU this is the same operation as x / v."""
    return x / torch.full((), v, dtype=x.dtype, device=x.device)


def bits_f32(b: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (0 .. 2^32-1) -> fp32 tensor."""
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as fp32 bits (int64). NaN bits lie above Inf, so a max over them finds NaN too."""
    return f32_bits(x.to(torch.float32)) & F32_ABS_MASK


def round_mag_rne(u: torch.Tensor, mbits: int, bias: int) -> torch.Tensor:
    """Round finite fp32 magnitudes (bits u) to nearest even on a format with `mbits` mantissa
    bits and exponent bias `bias`; returns the unsaturated magnitude code (exponent << mbits |
    mantissa). Mirrors round_mag_rne in bits.h."""
    shift = 23 - mbits
    min_normal_field = 127 + 1 - bias
    e = u >> 23
    rn = (u + ((1 << (shift - 1)) - 1) + ((u >> shift) & 1)) >> shift
    cn = rn - ((127 - bias) << mbits)
    mant = (u & 0x007FFFFF) | 0x00800000
    d = torch.clamp(shift + (min_normal_field - e), 1, 31)
    one = torch.ones_like(d)
    rs = (mant + ((one << (d - 1)) - 1) + ((mant >> d) & 1)) >> d
    return torch.where(e >= min_normal_field, cn, rs)


def encode(x: torch.Tensor, el: Element) -> torch.Tensor:
    """fp32 -> element codes (uint8, one per element): round to nearest even, saturate finite
    overflow and +-Inf to +-max, keep the sign (also of zero), NaN -> the NaN code with its
    sign for FP8 and +0 for E2M1."""
    b = f32_bits(x.to(torch.float32))
    u = b & F32_ABS_MASK
    c = torch.clamp(round_mag_rne(u, el.mbits, el.bias), max=el.max_code)
    sign = (b >> 31) << (el.ebits + el.mbits)
    nan = (sign | el.nan_code) if el.nan_code else torch.zeros_like(sign)
    return torch.where(u > F32_INF_BITS, nan, c | sign).to(torch.uint8)


def decode(codes: torch.Tensor, el: Element) -> torch.Tensor:
    """Element codes (uint8) -> fp32, exactly (OCP semantics for NaN/Inf codes)."""
    c = codes.to(torch.int64)
    nbits = el.ebits + el.mbits
    sign = ((c >> nbits) & 1).to(torch.bool)
    mag = c & ((1 << nbits) - 1)
    e = mag >> el.mbits
    m = mag & ((1 << el.mbits) - 1)
    unit = 2.0 ** (1 - el.bias - el.mbits)
    sub = m.to(torch.float32) * unit
    normal = bits_f32(((e - el.bias + 127) << 23) | (m << (23 - el.mbits)))
    v = torch.where(e == 0, sub, normal)
    if el.name == "e4m3":
        v = torch.where(mag == 0x7F, torch.nan, v)
    if el.name == "e5m2":
        v = torch.where(e == 31, torch.where(m == 0, torch.inf, torch.nan), v)
    return torch.where(sign, -v, v)


# ---- E8M0 (MX scales): a code c stands for 2^(c - 127); 255 is NaN ---------------------------


def _clamp_exponent(e: torch.Tensor) -> torch.Tensor:
    return torch.clamp(e, -127, 127) + 127


def e8m0_floor(amax_bits: torch.Tensor, el: Element) -> torch.Tensor:
    """OCP MX FLOOR: floor(log2 amax) - emax_elem, from the exponent field."""
    return _clamp_exponent((amax_bits >> 23) - 127 - el.emax)


def e8m0_even(amax_bits: torch.Tensor, el: Element) -> torch.Tensor:
    """torchao EVEN: round amax to the element's mantissa width on the bits, then FLOOR."""
    r = (amax_bits + (1 << (22 - el.mbits))) & 0xFF800000
    return _clamp_exponent((r >> 23) - 127 - el.emax)


def e8m0_rceil(amax_bits: torch.Tensor, el: Element) -> torch.Tensor:
    """NVIDIA RCEIL: d = amax / max_elem in fp32, rounded up to a power of two on its bits."""
    d = f32_bits(div(bits_f32(amax_bits), el.max_value))
    field = d >> 23
    mant = d & 0x007FFFFF
    sub = (mant > 0x00400000).to(torch.int64)
    code = torch.where(field == 0, sub, field + (mant != 0).to(torch.int64))
    return torch.clamp(code, max=254)


def e8m0_code(amax_bits: torch.Tensor, el: Element, rule: str) -> torch.Tensor:
    if rule == "rceil":
        return e8m0_rceil(amax_bits, el)
    if rule == "even":
        return e8m0_even(amax_bits, el)
    assert rule == "floor", rule
    return e8m0_floor(amax_bits, el)


def e8m0_inverse(code: torch.Tensor) -> torch.Tensor:
    """2^(127 - code) in fp32, exact for codes 0..254 (254 gives the subnormal 2^-127)."""
    return bits_f32(torch.where(code >= 254, 0x00400000, (254 - code) << 23))


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) in fp32 (code 0 is the subnormal 2^-127; 255 is NaN)."""
    c = code.to(torch.int64)
    b = torch.where(c == 0, 0x00400000, c << 23)
    return bits_f32(torch.where(c == 255, F32_QUIET_NAN, b))
