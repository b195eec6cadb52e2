"""Every format, granularity and scale rule: the native kernels and the PyTorch reference give
the same bits (data, scales, global scales) on every bf16 and fp16 bit pattern laid out as
blocks, on random data of every input dtype, on shapes the blocks do not divide, on empty
tensors and on stacked experts; plus the contract's semantics for zero and poisoned groups."""

from __future__ import annotations

import math

import pytest
import torch
from _quant_testlib import (
    all_bf16,
    all_fp16,
    assert_same_quantized,
    bits,
    format_cases,
    require_native,
)

import miles_quant as mq

CASES = format_cases()
IDS = [f"{f}-{g}-{r}" for f, g, r in CASES]


def _both(
    x: torch.Tensor, fmt: str, gran: str, rule: str | None, **kw: object
) -> mq.QuantizedTensor:
    require_native()
    nat = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native", **kw)  # type: ignore[arg-type]
    ref = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="torch", **kw)  # type: ignore[arg-type]
    assert_same_quantized(nat, ref)
    return nat


def _as_matrix(v: torch.Tensor, cols: int) -> torch.Tensor:
    return v.reshape(-1, cols)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("source", ["bf16", "fp16"])
def test_every_bit_pattern_native_equals_reference(
    fmt: str, gran: str, rule: str | None, source: str
) -> None:
    # All 65,536 patterns (NaN, Inf, subnormals, zeros of both signs included) as a [512, 128]
    # matrix in bit order, and shuffled so that every block mixes magnitudes.
    v = (all_bf16 if source == "bf16" else all_fp16)()
    g = torch.Generator().manual_seed(0)
    shuffled = v[torch.randperm(v.numel(), generator=g)]
    finite = shuffled[torch.isfinite(shuffled.float())]
    for x in (
        _as_matrix(v, 128),
        _as_matrix(shuffled, 128),
        finite[: 65536 // 2 * 2][:32768].reshape(128, 256),
    ):
        _both(x, fmt, gran, rule)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("cols", [4096, 4144])
def test_every_bit_pattern_in_wide_rows_native_equals_reference(
    fmt: str, gran: str, rule: str | None, cols: int
) -> None:
    # The AVX-512 kernels take 16 blocks (groups, tiles) of a row at a time, with an unmasked
    # path for whole batches: rows of 4096 are all whole batches, 4144 = 4096 + 48 ends in a
    # partial batch with a partial block. Every bf16 and fp16 pattern, shuffled, lands in them.
    g = torch.Generator().manual_seed(7)
    for v in (all_bf16(), all_fp16()):
        shuffled = v[torch.randperm(v.numel(), generator=g)]
        finite = shuffled[torch.isfinite(shuffled.float())]
        # fp32 too: the same values with mantissa bits below the 16-bit grids.
        for src in (shuffled, finite, finite.float() * (1 + 2.0**-17)):
            x = src[: (src.numel() // cols) * cols].reshape(-1, cols)
            if gran == "16x16":
                x = x[: x.shape[0] // 16 * 16]
            _both(x, fmt, gran, rule)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_native_equals_reference(
    fmt: str, gran: str, rule: str | None, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(1)
    # Magnitudes spread over many binades, per row and per column, plus exact zeros.
    x = torch.randn(96, 320, generator=g) * torch.logspace(-6, 4, 320).unsqueeze(0)
    x = x * torch.logspace(-2, 2, 96).unsqueeze(1)
    x[5, :] = 0
    x[:, 7] = 0
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    _both(x.to(dtype), fmt, gran, rule)
    if dtype == torch.float32:  # fp32 values below the bf16/fp16 grids: subnormal fp32 too
        tiny = torch.randn(32, 64, generator=g) * 2.0**-130
        _both(tiny, fmt, gran, rule)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize(
    "shape", [(1,), (3,), (33,), (5, 17), (130, 129), (2, 3, 47), (17, 16), (0, 64), (4, 0)]
)
def test_shapes_native_equals_reference(
    fmt: str, gran: str, rule: str | None, shape: tuple[int, ...]
) -> None:
    if gran in ("128x128",) and len(shape) < 2:
        pytest.skip("needs [..., N, K]")
    if gran == "16x16" and len(shape) != 2:
        pytest.skip("needs [N, K]")
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    q = _both(x, fmt, gran, rule)
    assert q.shape == shape
    k = shape[-1]
    family = mq.FORMATS[fmt].family
    if family in ("nvfp4", "int4") or fmt == "mxfp4":
        assert q.data.shape == (*shape[:-1], (k + 1) // 2)
    else:
        assert q.data.shape == shape
    out = mq.dequantize(q, torch.float32)
    assert out.shape == shape


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
def test_stacked_experts_get_their_own_scales(fmt: str, gran: str, rule: str | None) -> None:
    g = torch.Generator().manual_seed(3)
    # Experts with very different ranges: per-expert tensor-level scales must not mix them.
    w = torch.randn(4, 48, 160, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 500.0]).view(4, 1, 1)
    w = w.to(torch.bfloat16)
    q = _both(w, fmt, gran, rule, stacked=True)
    for e in range(4):
        alone = mq.quantize(w[e], fmt, granularity=gran, scale_rule=rule, backend="torch")
        assert torch.equal(bits(q.data[e]), bits(alone.data))
        if gran == "tensor":
            assert torch.equal(bits(q.scales[e]), bits(alone.scales))
        else:
            assert torch.equal(bits(q.scales[e]), bits(alone.scales))
        if q.global_scale is not None:
            assert alone.global_scale is not None
            assert torch.equal(bits(q.global_scale[e]), bits(alone.global_scale))


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("shape", [(96, 128), (3, 34, 384), (51, 768), (4099, 32), (2, 5, 16)])
def test_narrow_rows_native_equals_reference(
    fmt: str, gran: str, rule: str | None, shape: tuple[int, ...]
) -> None:
    # The CPU scheduler runs narrow rows of whole 1xG groups as fewer, longer rows (cpu.cpp,
    # merged_rows): 96x128 as 2x6144, 34 rows of 384 per matrix as 2 of 6528, 51x768 as
    # 17x2304; 4099 (prime) rows of 32 stay as they are. A NaN poisons only its own group, in a
    # row that was merged with its neighbours.
    if gran == "16x16" and len(shape) != 2:
        pytest.skip("needs [N, K]")
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    x.view(-1, shape[-1])[1, shape[-1] - 1] = float("nan")
    stacked = len(shape) == 3 and gran in ("tensor", "1x16")
    q = _both(x, fmt, gran, rule, stacked=stacked)
    if gran == "1x32":  # MX and INT4 g32: the NaN's group alone has a NaN scale
        scales = q.scales.reshape(-1, q.scales.shape[-1]).float()
        assert torch.isnan(scales[1, -1]).item()
        assert torch.isnan(scales).sum().item() == 1
    for t in (2, 3):
        other = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, stacked=stacked, threads=t)
        assert_same_quantized(q, other)


@pytest.mark.parametrize(
    ("fmt", "gran", "rule"), [c for c in CASES if c[1] == "128x128"], ids=lambda v: str(v)
)
@pytest.mark.parametrize(("dtype", "cols"), [(torch.bfloat16, 33100), (torch.float32, 16500)])
def test_128x128_rows_wider_than_a_band_native_equals_reference(
    fmt: str, gran: str, rule: str | None, dtype: torch.dtype, cols: int
) -> None:
    # The AVX-512 128x128 kernel takes a tile row in bands of at most 8 MiB of input (256 bf16
    # or 128 fp32 tiles); wider rows are split into column chunks, each with its own two passes.
    # A NaN poisons only its tile, in the second chunk.
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(130, cols, generator=g) * 3).to(dtype)
    x[5, cols - 200] = float("nan")
    q = _both(x, fmt, gran, rule)
    nan_tile = (0, (cols - 200) // 128)
    assert torch.isnan(q.scales[nan_tile]).item()
    assert torch.isnan(q.scales).sum().item() == 1


def test_nvfp4_every_tensor_amax_mantissa_native_equals_reference() -> None:
    # The AVX512-VBMI kernel picks its element tables by the global scale: one table for 118 of
    # the 128 mantissas a bf16 amax can have, 8 tables for the rest (avx512_nvfp4_tables.h).
    # Expert e's amax has mantissa e, so every choice is taken; rows of 512 take the batched loop.
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 4, 512, generator=g).clamp(-3.5, 3.5)
    amax = (1 + torch.arange(128) / 128) * 4.0
    w[:, 0, 0] = -amax
    exponents = torch.tensor([1.0, 2.0**-20, 2.0**30, 1.0]).repeat(32).view(128, 1, 1)
    q = _both((w * exponents).to(torch.bfloat16), "nvfp4", "1x16", None, stacked=True)
    assert q.global_scale is not None
    assert q.global_scale.unique().numel() == 128


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
def test_result_does_not_depend_on_thread_count(fmt: str, gran: str, rule: str | None) -> None:
    require_native()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 544, generator=g).to(torch.bfloat16)
    base = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native", threads=1)
    for t in (2, 3, 7):
        other = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native", threads=t)
        assert_same_quantized(base, other)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
def test_native_ignores_the_callers_flush_to_zero_mode(
    fmt: str, gran: str, rule: str | None
) -> None:
    require_native()
    g = torch.Generator().manual_seed(5)
    # Rows of normal and of subnormal fp32 values: MX blocks then have subnormal inputs and
    # scaled values (the FP8, NVFP4 and INT4 scale clamps keep those formats away from them).
    x = torch.randn(66, 128, generator=g) * 2.0**-120
    x[::3] *= 2.0**-8
    x[1::3] *= 2.0**-20
    ref = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="torch")
    try:
        if not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush denormals")
        nat = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="native")
        ref_flushed = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, backend="torch")
    finally:
        torch.set_flush_denormal(False)
    assert_same_quantized(nat, ref)
    if mq.FORMATS[fmt].family == "mx":  # the input does exercise flush-to-zero
        assert not torch.equal(bits(ref_flushed.data), bits(ref.data))


# ---- contract semantics ---------------------------------------------------------------------


def _group_shape(fmt: str, gran: str) -> tuple[int, int]:
    return {
        "tensor": (64, 256),
        "channel": (1, 256),
        "1x128": (1, 128),
        "128x128": (128, 128),
        "1x32": (1, 32),
        "1x16": (1, 16),
        "16x16": (16, 16),
    }[gran]


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_poisons_exactly_its_scale_group(
    fmt: str, gran: str, rule: str | None, bad: float
) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 256, generator=g)
    x[3, 37] = bad
    q = _both(x, fmt, gran, rule)
    out = mq.dequantize(q, torch.float32)
    gr, gc = _group_shape(fmt, gran)
    family = mq.FORMATS[fmt].family
    if family == "nvfp4":  # the global scale covers the whole tensor
        gr, gc = 64, 256
    r0, c0 = 3 // gr * gr, 37 // gc * gc
    group = torch.zeros_like(out, dtype=torch.bool)
    group[r0 : r0 + gr, c0 : c0 + gc] = True
    assert torch.isnan(out[group]).all()
    assert torch.isfinite(out[~group]).all()
    if family == "nvfp4":
        assert q.global_scale is not None
        assert math.isnan(q.global_scale.item())


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
def test_all_zero_groups_quantize_to_zero_with_the_contract_scale(
    fmt: str, gran: str, rule: str | None
) -> None:
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    q = _both(x, fmt, gran, rule)
    assert not torch.any(mq.dequantize(q, torch.float32))
    family = mq.FORMATS[fmt].family
    s = q.scales.reshape(-1)
    if family == "fp8":  # max(0, 1e-10) / max_elem
        el = mq.FORMATS[fmt].element
        assert el is not None
        want = torch.tensor(1e-10, dtype=torch.float32) / el.max_value
        assert torch.equal(s, want.expand_as(s))
    elif family == "mx":
        want_code = 0  # every rule: 2^-127
        assert torch.equal(s.view(torch.uint8), torch.full_like(s.view(torch.uint8), want_code))
    elif family == "nvfp4":
        assert q.global_scale is not None
        assert q.global_scale.item() == (torch.tensor(1e-10) / 2688.0).item()
        assert torch.equal(s.view(torch.uint8), torch.full_like(s.view(torch.uint8), 0x08))  # 2^-6
    else:
        assert torch.equal(
            s.float(), torch.full_like(s.float(), torch.tensor(1e-5).to(s.dtype).item())
        )
    # Codes are +0 (FP8/FP4 code 0, INT4 q + 8 = 8).
    zero_code = 0x88 if family == "int4" else 0
    assert torch.equal(
        q.data.view(torch.uint8), torch.full_like(q.data.view(torch.uint8), zero_code)
    )


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_scale_dtypes_native_equals_reference(
    fmt: str, dtype: torch.dtype, scale_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 300, generator=g) * torch.logspace(-8, 5, 300)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    if dtype == torch.float32:
        x[0, :64] = 1e9  # float16 scales saturate at 65504 (codes clamp at +-7)
    q = _both(x.to(dtype), fmt, mq.FORMATS[fmt].granularities[0], None, scale_dtype=scale_dtype)
    assert q.scales.dtype == scale_dtype
    if dtype == torch.float32 and scale_dtype == torch.float16:
        assert q.scales[0, 0].item() == 65504.0
        assert mq.unpack_int4(q.data, 300)[0, 0].item() == 7
    # Codes are computed against the stored scale: dequantization is q * float(stored scale).
    codes = mq.unpack_int4(q.data, 300).float()
    want = codes * q.scales.float().repeat_interleave(mq.FORMATS[fmt].group, dim=-1)[:, :300]
    assert torch.equal(bits(mq.dequantize(q, torch.float32)), bits(want))
