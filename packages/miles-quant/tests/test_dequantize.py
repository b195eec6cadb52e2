"""dequantize: the native CPU kernels against the torch reference, bit for bit.

Exhaustive where the space is small: every element code against every scale code (E8M0, the
NVFP4 E4M3 block scales under edge global scales) and every bf16 and fp16 INT4 scale; fp32
scales from edge values plus random bit patterns over the whole exponent range (products that
overflow, land in the subnormals of every output dtype, or round on a tie). Then round trips of
real quantize results over every format, granularity, shape and input dtype; every instruction
set in a subprocess; the layout and `out` errors; the canonical NaNs on both backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _quant_testlib import all_bf16, all_fp16, bits, format_cases, require_native, run_with_isa

import miles_quant as mq
from miles_quant import _native

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CANONICAL = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def _f32(*bit_patterns: int) -> torch.Tensor:
    return torch.tensor(bit_patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _edge_f32_scales(n_random: int = 512) -> torch.Tensor:
    """fp32 scales: edges (zeros, subnormals, extremes, Inf, NaN, both signs) and random bit
    patterns with every exponent."""
    edges = _f32(
        0x00000000, 0x80000000, 0x00000001, 0x00400000, 0x007FFFFF, 0x00800000, 0x3F800000,
        0xBF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
        0x7F800001, 0x33800000, 0x38800000, 0x3B124925, 0x43124925, 0x47800000, 0x477FE000,
        0x387FC000, 0x2F800000, 0x3C924925,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(0, 2**32, (n_random,), generator=g, dtype=torch.int64)
    return torch.cat([edges, rand.to(torch.int32).view(torch.float32)])


def _assert_backends_agree(q: mq.QuantizedTensor) -> None:
    for dtype in OUT_DTYPES:
        native = mq.dequantize(q, dtype, backend="native")
        ref = mq.dequantize(q, dtype, backend="torch")
        assert native.shape == ref.shape == torch.Size(q.shape)
        assert native.dtype == ref.dtype == dtype
        if not torch.equal(bits(native), bits(ref)):
            where = (bits(native) != bits(ref)).nonzero()[:5].tolist()
            raise AssertionError(f"{q.format} {q.granularity} -> {dtype}: differ at {where}")


def _grid_cases() -> list[mq.QuantizedTensor]:
    cases = []
    codes = torch.arange(256, dtype=torch.uint8)
    # FP8 1x128: every code against every edge scale (two groups per row, scales rolled).
    s = _edge_f32_scales()
    for fmt, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        data = codes.repeat(s.numel(), 1).view(dt)
        scales = torch.stack([s, s.roll(1)], dim=1).contiguous()
        cases.append(
            mq.QuantizedTensor(data, scales, fmt, tuple(data.shape), torch.float32, "1x128")
        )
        # 128x128 tiles with partial edges, per tensor, stacked per tensor.
        tiles = codes.repeat(200, 2)[:, :300].contiguous().view(dt)
        t_scales = s[:6].reshape(2, 3).contiguous()
        block = "fp8_block128" if fmt == "fp8_e4m3" else None
        if block is not None:
            cases.append(
                mq.QuantizedTensor(tiles, t_scales, block, (200, 300), torch.float32, "128x128")
            )
        for v in s[:24]:
            cases.append(
                mq.QuantizedTensor(
                    tiles, v.reshape(()).clone(), fmt, (200, 300), torch.float32, "tensor"
                )
            )
        stacked = codes.repeat(3, 5, 1).contiguous().view(dt)
        cases.append(
            mq.QuantizedTensor(
                stacked, s[10:13].clone(), fmt, (3, 5, 256), torch.float32, "tensor", stacked=True
            )
        )
        chan = codes.repeat(24, 1).view(dt)
        cases.append(
            mq.QuantizedTensor(
                chan, s[:24].reshape(24, 1).clone(), fmt, (24, 256), torch.float32, "channel"
            )
        )
    # MX FP8: row r holds all 256 codes in 8 groups whose scale codes (r + 37 j) % 256 give every
    # code every scale code over the rows. MXFP4: a row is one block holding the 16 codes twice.
    sc = (torch.arange(256).reshape(-1, 1) + 37 * torch.arange(8)) % 256
    sc = sc.to(torch.uint8).view(torch.float8_e8m0fnu)
    for fmt, dt in (("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2)):
        data = codes.repeat(256, 1).view(dt)
        cases.append(mq.QuantizedTensor(data, sc, fmt, (256, 256), torch.float32, "1x32", "floor"))
    nib = torch.arange(16, dtype=torch.uint8)
    packed16 = nib[0::2] | (nib[1::2] << 4)  # 8 bytes: codes 0..15 in order
    # MXFP4: a row of 256 blocks, each the 16 codes twice, scale codes 0..255 (rolled by row).
    fp4 = packed16.repeat(3, 512)
    fp4_scales = torch.stack([codes.roll(i) for i in range(3)]).view(torch.float8_e8m0fnu)
    cases.append(
        mq.QuantizedTensor(fp4, fp4_scales, "mxfp4", (3, 8192), torch.float32, "1x32", "floor")
    )
    # NVFP4: rows of 256 blocks of the 16 codes with block scale codes 0..255, rolled by row (so
    # both halves of a 32-element step see every code), under edge global scales (one per
    # expert); also one not stacked, and rows whose last block is partial.
    g = _f32(0x3F800000, 0x00800000, 0x0DA24260, 0x7F7FFFFF, 0x39C30C31, 0x2A000000, 0x5F000000)
    e = g.numel()
    nv = packed16.repeat(e, 2, 256).contiguous()
    nv_scales = torch.stack([codes.roll(i) for i in range(2)]).repeat(e, 1, 1).contiguous()
    nv_scales = nv_scales.view(torch.float8_e4m3fn)
    cases.append(
        mq.QuantizedTensor(
            nv, nv_scales, "nvfp4", (e, 2, 4096), torch.float32, "1x16", None, g, True
        )
    )
    cases.append(
        mq.QuantizedTensor(
            nv[2], nv_scales[2], "nvfp4", (2, 4096), torch.float32, "1x16", None, g[2].clone()
        )
    )
    odd = packed16.repeat(5, 7)[:, :53].contiguous()  # K = 105: 6 full blocks and 9 codes
    odd_scales = codes[100:135].reshape(5, 7).contiguous().view(torch.float8_e4m3fn)
    cases.append(
        mq.QuantizedTensor(
            odd, odd_scales, "nvfp4", (5, 105), torch.float32, "1x16", None, g[4].clone()
        )
    )
    # INT4: every bf16 and every fp16 scale, fp32 edge scales; a group of 32 holds 0..15 twice.
    for scales in (all_bf16(), all_fp16(), _edge_f32_scales(4096)):
        n = scales.numel()
        data = packed16.repeat(n, 2)
        cases.append(
            mq.QuantizedTensor(
                data, scales.reshape(n, 1), "int4_g32", (n, 32), scales.dtype, "1x32"
            )
        )
    return cases


def test_every_code_against_every_scale_code_and_edge_scale() -> None:
    require_native()
    cases = _grid_cases()
    assert len(cases) > 60
    for q in cases:
        _assert_backends_agree(q)


def _round_trip_inputs() -> list[tuple[torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for shape in ((3, 5, 300), (2, 129, 77), (64,), (4, 256), (32, 1024), (1, 0)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            n = shape[-1]
            x = torch.randn(shape, generator=g) * torch.logspace(-5, 5, max(n, 1))[:n]
            out.append((x.to(dtype), len(shape) == 3))
            if x.numel() > 40:  # and with a NaN and an Inf (poisoned groups, or all of NVFP4)
                x.view(-1)[7] = float("nan")
                x.view(-1)[-3] = float("-inf")
                out.append((x.to(dtype), len(shape) == 3))
    return out


@pytest.mark.parametrize(
    "case", format_cases(), ids=["-".join(map(str, c)) for c in format_cases()]
)
def test_round_trips_of_real_results(case: tuple[str, str, str | None]) -> None:
    require_native()
    fmt, gran, rule = case
    for x, can_stack in _round_trip_inputs():
        if gran in ("128x128", "16x16") and x.dim() < 2:
            continue
        if gran == "16x16" and x.dim() != 2:
            continue
        for stacked in (False, True) if can_stack and gran in ("tensor", "1x16") else (False,):
            kw = {"scale_dtype": x.dtype} if fmt.startswith("int4") else {}
            q = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, stacked=stacked, **kw)
            _assert_backends_agree(q)


def test_threads_and_out_give_the_same_bits() -> None:
    require_native()
    x = torch.randn(96, 4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for fmt in ("nvfp4", "int4_g128", "fp8_block128", "mxfp4"):
        q = mq.quantize(x, fmt)
        one = mq.dequantize(q, torch.bfloat16, threads=1)
        out = torch.full(x.shape, 7.0, dtype=torch.bfloat16)
        two = mq.dequantize(q, torch.bfloat16, threads=2, out=out)
        assert two is out
        assert torch.equal(bits(one), bits(two))
        ref_out = torch.empty(x.shape, dtype=torch.bfloat16)
        assert mq.dequantize(q, torch.bfloat16, backend="torch", out=ref_out) is ref_out
        assert torch.equal(bits(ref_out), bits(one))


def test_poisoned_groups_give_the_canonical_nan_on_both_backends() -> None:
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    x[2, 40] = float("-inf")
    backends = ("torch", "native") if _native.available() else ("torch",)
    for fmt in ("fp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4", "int4_g32"):
        q = mq.quantize(x, fmt, granularity="tensor" if fmt == "fp8_e4m3" else None)
        for backend in backends:
            for dtype in OUT_DTYPES:
                y = mq.dequantize(q, dtype, backend=backend)
                nan = torch.isnan(y)
                assert nan.any(), (fmt, backend, dtype)
                assert (bits(y)[nan.reshape(-1)] == CANONICAL[dtype]).all(), (fmt, backend, dtype)


def test_negative_nan_code_is_canonical_too() -> None:
    data = torch.tensor([[0xFF, 0x7F, 0x80, 0x01]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = mq.QuantizedTensor(data, torch.tensor(-2.0), "fp8_e4m3", (1, 4), torch.float32, "tensor")
    for backend in ("torch", "native") if _native.available() else ("torch",):
        y = mq.dequantize(q, torch.bfloat16, backend=backend)
        # NaN codes of both signs; -0 * -2 = +0; code 0x01 is 2^-9, times -2 is -2^-8 (bf16 0xBB80)
        assert bits(y).tolist() == [0x7FC0, 0x7FC0, 0x0000, 0xBB80 - 0x10000]
        assert y.float()[0, 3].item() == -(2.0**-8)


def test_layout_errors_name_the_buffer() -> None:
    x = torch.randn(8, 64)
    q = mq.quantize(x, "mxfp4")
    bad = mq.QuantizedTensor(q.data, q.scales[:, :1], "mxfp4", q.shape, q.dtype, "1x32", "floor")
    with pytest.raises(ValueError, match="needs scales"):
        mq.dequantize(bad)
    wrong_dtype = mq.QuantizedTensor(
        q.data, q.scales.view(torch.uint8), "mxfp4", q.shape, q.dtype, "1x32", "floor"
    )
    with pytest.raises(ValueError, match="needs scales"):
        mq.dequantize(wrong_dtype, backend="torch")
    q8 = mq.quantize(x, "fp8_e4m3", granularity="1x128")
    as_bytes = mq.QuantizedTensor(
        q8.data.view(torch.uint8), q8.scales, "fp8_e4m3", q8.shape, q8.dtype, "1x128"
    )
    with pytest.raises(ValueError, match="needs data"):
        mq.dequantize(as_bytes)
    gran = mq.QuantizedTensor(q8.data, q8.scales, "fp8_e4m3", q8.shape, q8.dtype, "1x32")
    with pytest.raises(ValueError, match="granularities"):
        mq.dequantize(gran)
    with pytest.raises(ValueError, match="out must have shape"):
        mq.dequantize(q, torch.float32, out=torch.empty(8, 63))
    with pytest.raises(ValueError, match="out must have shape"):
        mq.dequantize(q, torch.float32, out=torch.empty(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        mq.dequantize(q, torch.float32, out=torch.empty(64, 8).t())
    with pytest.raises(ValueError, match="threads"):
        mq.dequantize(q, threads=0)
    with pytest.raises(ValueError, match="backend"):
        mq.dequantize(q, backend="fast")  # type: ignore[arg-type]
    meta = mq.QuantizedTensor(
        q.data.to("meta"), q.scales.to("meta"), "mxfp4", q.shape, q.dtype, "1x32", "floor"
    )
    with pytest.raises(ValueError, match="CPU tensors only"):
        mq.dequantize(meta, backend="native")


def test_the_binding_checks_sizes() -> None:
    require_native()
    ext = _native._ext
    assert ext is not None
    data = torch.zeros(4, 16, dtype=torch.uint8)
    scales = torch.ones(4, 1)
    out = torch.empty(4, 32)
    args = [
        data.data_ptr(),
        data.nbytes,
        3,
        1,
        4,
        32,
        1,
        32,
        scales.data_ptr(),
        scales.nbytes,
        0,
        0,
        0,
    ]
    ext.dequantize(*args, out.data_ptr(), out.nbytes, 0, 1)
    assert (out == -8.0).all()  # code 0 is q = -8, scale 1
    with pytest.raises(ValueError, match="dequantize: out size"):
        ext.dequantize(*args, out.data_ptr(), out.nbytes - 4, 0, 1)
    with pytest.raises(ValueError, match="dequantize: scales size"):
        ext.dequantize(*args[:9], scales.nbytes - 4, *args[10:], out.data_ptr(), out.nbytes, 0, 1)
    with pytest.raises(ValueError, match="dequantize: data size"):
        ext.dequantize(args[0], args[1] - 1, *args[2:], out.data_ptr(), out.nbytes, 0, 1)
    with pytest.raises(ValueError, match="global_scale size"):
        ext.dequantize(*args[:11], scales.data_ptr(), 8, out.data_ptr(), out.nbytes, 0, 1)


# Dequantizes the grid cases on the native backend in a subprocess with a forced ISA.
_CHILD = """
import sys, torch, miles_quant as mq
from miles_quant import _native
sys.path.insert(0, sys.argv[3])
from test_dequantize import OUT_DTYPES, _grid_cases
assert _native.isa() == sys.argv[1], (_native.isa(), sys.argv[1])
out = [[mq.dequantize(q, d, backend="native") for d in OUT_DTYPES] for q in _grid_cases()]
torch.save(out, sys.argv[2])
"""


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_every_isa_dequantizes_to_the_same_bits(isa: str, tmp_path: Path) -> None:
    theirs = run_with_isa(_CHILD, isa, tmp_path)
    assert isinstance(theirs, list)
    cases = _grid_cases()
    assert len(theirs) == len(cases)
    for q, outs in zip(cases, theirs, strict=True):
        for d, y in zip(OUT_DTYPES, outs, strict=True):
            assert torch.equal(bits(y), bits(mq.dequantize(q, d, backend="native"))), (q.format, d)
