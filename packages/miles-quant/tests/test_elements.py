"""Element formats, exhaustively: every bf16 and every fp16 bit pattern through E4M3, E5M2 and
E2M1 (native vs reference vs torch casts vs ml_dtypes), every code decoded, and the E8M0 scale
rules against exact arithmetic.

Where an oracle differs from the contract, the test asserts that the differing inputs are
exactly the documented set (docs/contract.md, "Where implementations disagree").
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np  # pants: no-infer-dep (numpy comes with ml_dtypes)
import pytest
import torch
from _quant_testlib import all_bf16, all_fp16, require_native

from miles_quant import _bits, _native
from miles_quant._spec import E2M1, E4M3, E5M2, ELEMENTS, Element

INPUTS = {"bf16": all_bf16, "fp16": all_fp16}
ML_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
}


def _f32(source: str) -> torch.Tensor:
    return INPUTS[source]().to(torch.float32)


def _ml_codes(x: torch.Tensor, el: Element) -> torch.Tensor:
    codes = x.numpy().astype(ML_DTYPES[el.name]).view(np.uint8)
    return torch.from_numpy(codes.copy())


@pytest.mark.parametrize("source", sorted(INPUTS))
@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_native_encode_equals_reference_on_every_pattern(source: str, name: str) -> None:
    require_native()
    el = ELEMENTS[name]
    x = _f32(source)
    ref = _bits.encode(x, el)
    nat = _native.encode(x, el)
    assert torch.equal(nat, ref), f"{(nat != ref).sum().item()} of 65536 codes differ"


@pytest.mark.parametrize("source", sorted(INPUTS))
def test_e4m3_equals_torch_cast_on_every_pattern(source: str) -> None:
    # torch >= 2.13 saturates E4M3 (finite overflow and Inf to +-448) and keeps NaN's sign.
    x = _f32(source)
    ours = _bits.encode(x, E4M3)
    torch_codes = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, torch_codes)


@pytest.mark.parametrize("source", sorted(INPUTS))
def test_e5m2_differs_from_torch_cast_only_where_torch_overflows_to_inf(source: str) -> None:
    # Documented: torch's E5M2 cast is IEEE (|x| >= 61440 and Inf -> Inf); we saturate to 57344.
    x = _f32(source)
    ours = _bits.encode(x, E5M2)
    theirs = x.to(torch.float8_e5m2).view(torch.uint8)
    overflow = ~torch.isnan(x) & (x.abs() >= 61440.0)
    assert torch.equal(ours != theirs, overflow)
    sign = (x < 0).to(torch.uint8) << 7
    assert torch.equal(ours[overflow], (0x7B | sign)[overflow])
    assert torch.equal(theirs[overflow], (0x7C | sign)[overflow])
    assert overflow.any()


@pytest.mark.parametrize("source", sorted(INPUTS))
@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_differs_from_ml_dtypes_only_where_documented(source: str, name: str) -> None:
    el = ELEMENTS[name]
    x = _f32(source)
    ours = _bits.encode(x, el)
    theirs = _ml_codes(x, el)
    nan = torch.isnan(x)
    if name == "e4m3":
        # ml_dtypes: |x| > 464 (rounds past 448) and Inf -> NaN; we saturate to 448.
        expected = ~nan & (x.abs() > 464.0)
    elif name == "e5m2":
        # ml_dtypes: |x| >= 61440 and Inf -> Inf; NaN -> 0x7E. We saturate, and NaN -> 0x7F.
        expected = nan | (x.abs() >= 61440.0)
    else:
        # E2M1 has no NaN; ml_dtypes writes the sign-flipped zero for NaN, we write +0.
        expected = nan & (theirs != 0)
    assert torch.equal(ours != theirs, expected)
    assert expected.any()


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_decode_every_code_matches_ml_dtypes(name: str) -> None:
    el = ELEMENTS[name]
    codes = torch.arange(1 << el.bits, dtype=torch.uint8)
    ours = _bits.decode(codes, el)
    theirs = torch.from_numpy(codes.numpy().view(ML_DTYPES[name]).astype(np.float32))
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    finite = ~torch.isnan(ours)
    assert torch.equal(ours[finite].view(torch.int32), theirs[finite].view(torch.int32))


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_encode_decode_round_trip_is_identity_on_codes(name: str) -> None:
    # Every non-NaN code decodes to a value that encodes back to the same code (-0 included);
    # E5M2's +-Inf saturate to +-max by contract.
    el = ELEMENTS[name]
    codes = torch.arange(1 << el.bits, dtype=torch.uint8)
    values = _bits.decode(codes, el)
    back = _bits.encode(values, el)
    keep = ~torch.isnan(values) & ~torch.isinf(values)
    assert torch.equal(back[keep], codes[keep])
    if name == "e5m2":
        assert back[codes == 0x7C].item() == 0x7B
        assert back[codes == 0xFC].item() == 0xFB


def test_rne_ties_and_boundaries() -> None:
    cases = {
        # value: (e4m3, e5m2, e2m1)
        0.25: (0x28, 0x34, 0x0),  # E2M1 tie 0 | 0.5 -> even 0
        0.75: (0x34, 0x3A, 0x2),  # E2M1 tie 0.5 | 1.0 -> even 1.0
        2.5: (0x42, 0x41, 0x4),  # E2M1 tie 2 | 3 -> even 2
        5.0: (0x4A, 0x45, 0x6),  # E2M1 tie 4 | 6 -> even 4
        464.0: (0x7E, 0x5F, 0x7),  # E4M3 tie 448 | (480) -> even 448
        465.0: (0x7E, 0x5F, 0x7),  # above: saturates
        2.0**-10: (0x00, 0x14, 0x0),  # E4M3 tie 0 | 2^-9 -> even 0
        3 * 2.0**-10: (0x02, 0x1A, 0x0),  # E4M3 tie 2^-9 | 2^-8 -> even 2^-8
        2.0**-17: (0x00, 0x00, 0x0),  # E5M2 tie 0 | 2^-16 -> even 0
        float("inf"): (0x7E, 0x7B, 0x7),
        -0.0: (0x80, 0x80, 0x8),
    }
    for v, want in cases.items():
        x = torch.tensor([v], dtype=torch.float32)
        got = tuple(int(_bits.encode(x, el)[0]) for el in (E4M3, E5M2, E2M1))
        assert got == want, (v, [hex(g) for g in got], [hex(w) for w in want])


# ---- E8M0 scale rules vs exact arithmetic -------------------------------------------------------


def _positive_finite_amax() -> torch.Tensor:
    """Every positive finite bf16 and fp16 value (and 0), as fp32, plus fp32 values just above,
    at and below powers of two, where float log2 shortcuts go wrong."""
    b = all_bf16().to(torch.float32)
    h = all_fp16().to(torch.float32)
    pows = torch.tensor([2.0**e for e in range(-149, 128)], dtype=torch.float64)
    near = torch.cat(
        [pows, pows * (1 + 2.0**-23), pows * (1 - 2.0**-24), pows * 1.75, pows * 1.875]
    )
    near = near[(near < 3.4e38) & (near > 0)].to(torch.float32)
    v = torch.cat([b, h, near, torch.tensor([0.0])])
    return torch.unique(v[torch.isfinite(v) & (v >= 0)])


def _floor_log2(a: float) -> int:
    _, e = math.frexp(a)  # a = m * 2^e, 0.5 <= m < 1: floor(log2 a) = e - 1, exactly
    return e - 1


def _code(e: int) -> int:
    return max(-127, min(127, e)) + 127


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_e8m0_floor_is_exact_floor_log2(name: str) -> None:
    el = ELEMENTS[name]
    amax = _positive_finite_amax()
    got = _bits.e8m0_floor(_bits.f32_bits(amax), el).tolist()
    want = [_code(-1000 if a == 0 else _floor_log2(a) - el.emax) for a in amax.tolist()]
    assert got == want


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_e8m0_rceil_is_exact_ceil_log2_of_fp32_descale(name: str) -> None:
    el = ELEMENTS[name]
    amax = _positive_finite_amax()
    got = _bits.e8m0_rceil(_bits.f32_bits(amax), el).tolist()
    descale = (amax / el.max_value).tolist()  # fp32 division, as the contract says
    want = []
    for d in descale:
        if d == 0:
            want.append(0)
            continue
        m, e = math.frexp(d)
        ceil_log2 = e - 1 if m == 0.5 else e
        want.append(min(254, max(0, ceil_log2 + 127)))
    assert got == want


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_e8m0_even_rounds_amax_half_up_to_element_precision(name: str) -> None:
    el = ELEMENTS[name]
    amax = _positive_finite_amax()
    got = _bits.e8m0_even(_bits.f32_bits(amax), el).tolist()
    want = []
    for a in amax.tolist():
        if a < 2.0**-126:  # the exponent field of a subnormal reads -127 (clamps to code 0)
            want.append(0)
            continue
        m, e = math.frexp(a)
        units = 2 ** (el.mbits + 1)
        if math.floor(m * units + 0.5) == units:  # rounds up to the next power of two
            e += 1
        want.append(_code(e - 1 - el.emax))
    assert got == want


def test_e8m0_value_and_inverse_are_exact_powers_of_two() -> None:
    codes = torch.arange(255, dtype=torch.int64)
    v = _bits.e8m0_value(codes).to(torch.float64)
    inv = _bits.e8m0_inverse(codes).to(torch.float64)
    want = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float64)
    assert torch.equal(v, want)
    assert torch.equal(inv, 1 / want)
    assert math.isnan(_bits.e8m0_value(torch.tensor([255])).item())
    # torch's own E8M0 dtype decodes the same way (code 0 is 2^-127, 255 is NaN).
    t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu).float()
    assert torch.equal(t[:255].to(torch.float64), want)
    assert math.isnan(t[255].item())


def test_e8m0_casts_differ_from_the_scale_rules_exactly_where_documented() -> None:
    # Contract, section 6: scales come from FLOOR / RCEIL / EVEN on bits, never from an E8M0
    # cast. torch's cast rounds the mantissa half up (a descale of 1.25 * 2^k becomes 2^k, below
    # the block's need, which RCEIL rounds up), maps 0 to code 0 and drops the sign; ml_dtypes
    # rounds the same way but maps 0 and negatives to NaN (0xFF).
    v = all_bf16().to(torch.float32)
    d = v[(v > 0) & (v < 2.0**118)]  # positive descales; d * 448 stays finite
    b = _bits.f32_bits(d)
    field, mant = b >> 23, b & 0x7FFFFF
    normal = field > 0
    d, field, mant = d[normal], field[normal], mant[normal]
    torch_code = d.to(torch.float8_e8m0fnu).view(torch.uint8).to(torch.int64)
    assert torch.equal(torch_code, field + (mant >= 0x400000).to(torch.int64))
    ml = torch.from_numpy(d.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).copy())
    assert torch.equal(ml.to(torch.int64), torch_code)
    # RCEIL of the same descale (amax = d * 448 is exact for bf16 d; the rule divides it back).
    rceil = _bits.e8m0_rceil(_bits.f32_bits(d * E4M3.max_value), E4M3)
    assert torch.equal(rceil, torch.clamp(field + (mant != 0).to(torch.int64), max=254))
    differ = (mant != 0) & (mant < 0x400000)
    assert torch.equal(rceil != torch_code, differ)
    assert differ.any()
    zero = torch.zeros(2)
    zero[1] = -0.0
    assert zero.to(torch.float8_e8m0fnu).view(torch.uint8).tolist() == [0, 0]
    assert zero.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).tolist() == [255, 255]


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_native_encode_equals_reference_on_fp32_ties(name: str) -> None:
    # fp32 inputs (the quantizers encode x * factor or x / s) with every sign, every exponent and
    # the top 7 mantissa bits, and low mantissa bits that make exact ties, values one ulp off a
    # tie and values far from one; plus random bit patterns. The AVX-512 kernels round E2M1 by a
    # different route (one fp32 addition onto the grid) than E4M3 / E5M2 (integer bits).
    require_native()
    el = ELEMENTS[name]
    top = torch.arange(2**16, dtype=torch.int64) << 16  # sign, exponent, 7 mantissa bits
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x3FFF, 0xC000], dtype=torch.int64)
    pats = (top.unsqueeze(1) | low.unsqueeze(0)).reshape(-1)
    g = torch.Generator().manual_seed(0)
    pats = torch.cat([pats, torch.randint(0, 2**32, (1 << 20,), generator=g, dtype=torch.int64)])
    x = pats.to(torch.int32).view(torch.float32)  # wraps to the same 32 bits
    ref = _bits.encode(x, el)
    nat = _native.encode(x, el)
    assert torch.equal(nat, ref), f"{(nat != ref).sum().item()} of {x.numel()} codes differ"
