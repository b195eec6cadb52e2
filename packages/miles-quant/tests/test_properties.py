"""Property tests (hypothesis) over edge values: subnormals, exact ties, max and max + ulp, powers
of two +- ulp, +-Inf, NaN, all-zero blocks, single outliers, shapes the blocks do not divide.

Properties: native == reference bit for bit; dequantization is exact where the contract says
it is; quantization is idempotent (codes and scales for FP8, MX FLOOR/EVEN and INT4; values for
MX RCEIL; NVFP4's codes and block scales, its global scale may move by an ulp); pack/unpack and
swizzle/unswizzle are inverse bijections.
"""

from __future__ import annotations

import math
import os

import torch
from _quant_testlib import assert_same_quantized, bits, format_cases, require_native
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import miles_quant as mq
from miles_quant import _bits

CASES = format_cases()

_EDGE = [
    0.0,
    -0.0,
    2.0**-149,
    2.0**-126 * (1 - 2.0**-23),
    2.0**-126,
    2.0**-127,
    2.0**-10,
    3 * 2.0**-10,
    2.0**-17,
    0.25,
    0.75,
    2.5,
    5.0,
    6.0,
    6.0 * (1 + 2.0**-23),
    7.0,
    448.0,
    448.0 * (1 + 2.0**-23),
    464.0,
    480.0,
    57344.0,
    61440.0,
    65504.0,
    1e-10,
    1e-5,
    3.3895313892515355e38,
    float("inf"),
    float("-inf"),
    float("nan"),
]
_POW2 = [
    s * 2.0**e * f
    for e in (-130, -64, -8, -1, 0, 1, 8, 15, 64, 126)
    for s in (1, -1)
    for f in (1, 1 + 2.0**-23, 1 - 2.0**-24)
]

edge_values = st.sampled_from(_EDGE + _POW2)
any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
normalish = st.floats(min_value=-1e4, max_value=1e4, width=32, allow_nan=False)


@st.composite
def tensors(draw: st.DrawFn, finite: bool = False) -> torch.Tensor:
    rows = draw(st.integers(1, 20))
    # Short rows, and rows long enough for the AVX-512 kernels' whole batches of 16 blocks
    # (MX 512, NVFP4 256, FP8 1x128 and INT4 g128 2048 columns), with and without a tail.
    cols = draw(st.one_of(st.integers(1, 300), st.sampled_from([256, 512, 560, 2048, 2100])))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    base_scale = draw(st.sampled_from([1e-30, 1e-6, 1e-2, 1.0, 1e3, 1e30]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * base_scale
    # A few edge values and single outliers at drawn positions; sometimes zero whole rows.
    n_edges = draw(st.integers(0, 12))
    pool = st.one_of(edge_values, any_f32) if not finite else st.one_of(edge_values, normalish)
    for _ in range(n_edges):
        v = draw(pool)
        if finite and not math.isfinite(v):
            continue
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] = v
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = 0
    if dtype == torch.float16 and finite:
        x = x.clamp(-65504, 65504)
    return x.to(dtype)


SETTINGS = settings(
    max_examples=int(os.environ.get("MQ_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(case=st.sampled_from(CASES), x=tensors())
def test_native_equals_reference(case: tuple[str, str, str | None], x: torch.Tensor) -> None:
    require_native()
    fmt, gran, rule = case
    if gran == "16x16" and x.dim() != 2:
        return
    nat = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native")
    ref = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="torch")
    assert_same_quantized(nat, ref)


@SETTINGS
@given(case=st.sampled_from(CASES), x=tensors(finite=True))
def test_quantization_is_idempotent(case: tuple[str, str, str | None], x: torch.Tensor) -> None:
    fmt, gran, rule = case
    q = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="torch")
    dq = mq.dequantize(q, torch.float32)
    if not torch.isfinite(dq).all():  # fp16 input saturated at the top of its range: skip
        return
    family = mq.FORMATS[fmt].family
    kw = {"scale_dtype": q.scales.dtype} if family == "int4" else {}
    q2 = mq.quantize(dq, fmt, granularity=gran, scale_rule=rule, backend="torch", **kw)  # type: ignore[arg-type]
    if rule == "rceil":
        # The scale may step down where the quantized amax sits on max_elem / 2; values stay.
        assert torch.equal(bits(mq.dequantize(q2, torch.float32)), bits(dq))
        return
    assert torch.equal(bits(q2.data), bits(q.data))
    assert torch.equal(bits(q2.scales), bits(q.scales))
    if family != "nvfp4":
        assert torch.equal(bits(mq.dequantize(q2, torch.float32)), bits(dq))
    else:
        assert q.global_scale is not None
        assert q2.global_scale is not None
        # One fp32 ulp (not a float64 one: math.ulp would be 2^29 times too strict).
        g1, g2 = q.global_scale, q2.global_scale
        ulp = torch.nextafter(g1, torch.full_like(g1, math.inf)) - g1
        assert ((g1 - g2).abs() <= ulp).all()


@SETTINGS
@given(x=tensors(finite=True), fmt=st.sampled_from(["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"]))
def test_mx_elements_are_the_nearest_grid_value(x: torch.Tensor, fmt: str) -> None:
    # With a power-of-two scale X, y = x / X is exact in fp32, and each element is the nearest
    # value of the element grid to y (half a step at y's binade), or +-max when y is beyond it.
    q = mq.quantize(x, fmt, backend="torch")
    el = mq.FORMATS[fmt].element
    assert el is not None
    k = x.shape[-1]
    scale = _bits.e8m0_value(q.scales.view(torch.uint8)).repeat_interleave(32, dim=-1)[..., :k]
    y = x.float() / scale
    v = mq.dequantize(q, torch.float32) / scale
    binade = torch.floor(torch.log2(torch.clamp(y.abs(), min=2.0 ** (1 - el.bias))))
    half_step = torch.exp2(binade - el.mbits) / 2
    saturated = y.abs() > el.max_value
    assert ((y - v).abs() <= half_step)[~saturated].all()
    assert torch.equal(v[saturated].abs(), torch.full_like(v[saturated], el.max_value))


@settings(max_examples=100, deadline=None)
@given(
    codes=st.lists(st.integers(0, 15), min_size=1, max_size=99),
    q=st.lists(st.integers(-8, 7), min_size=1, max_size=99),
)
def test_pack_unpack_round_trip(codes: list[int], q: list[int]) -> None:
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = mq.pack_fp4(c)
    assert packed.shape == ((len(codes) + 1) // 2,)
    assert torch.equal(mq.unpack_fp4(packed, len(codes)), c)
    assert int(packed[0]) & 0xF == codes[0]
    t = torch.tensor(q, dtype=torch.int8)
    p = mq.pack_int4(t)
    assert torch.equal(mq.unpack_int4(p, len(q)), t)
    if len(q) % 2:
        assert int(p[-1]) >> 4 == 8  # the pad nibble is the code of 0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 400), cols=st.integers(1, 40))
def test_swizzle_offsets_are_a_bijection_into_the_padded_buffer(rows: int, cols: int) -> None:
    off = mq.swizzle_offsets(rows, cols)
    rp, cp = mq.swizzled_shape(rows, cols)
    assert off.unique().numel() == rows * cols
    assert int(off.min()) >= 0
    assert int(off.max()) < rp * cp
    g = torch.Generator().manual_seed(rows * 100 + cols)
    s = torch.randint(0, 256, (2, rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
    sw = mq.swizzle_scales(s.view(torch.float8_e8m0fnu))
    assert sw.shape == (2, rp, cp)
    assert torch.equal(mq.unswizzle_scales(sw, rows, cols).view(torch.uint8), s)
    # Padding bytes are zero.
    flat = sw.view(torch.uint8).reshape(2, -1)
    mask = torch.ones(rp * cp, dtype=torch.bool)
    mask[off.reshape(-1)] = False
    assert not flat[:, mask].any()
