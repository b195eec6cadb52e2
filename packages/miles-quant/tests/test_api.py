"""The public API: output dtypes and shapes, clear errors for bad input, the torch fallback when
the extension is missing, and that importing the package touches no CUDA."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _quant_testlib import same_bits

import miles_quant as mq

EXPECTED = {
    # format: (data dtype, scales dtype) for a bf16 [256, 300] input
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float32, (256, 300), ()),
    "fp8_e5m2": (torch.float8_e5m2, torch.float32, (256, 300), ()),
    "fp8_block128": (torch.float8_e4m3fn, torch.float32, (256, 300), (2, 3)),
    "mxfp8_e4m3": (torch.float8_e4m3fn, torch.float8_e8m0fnu, (256, 300), (256, 10)),
    "mxfp8_e5m2": (torch.float8_e5m2, torch.float8_e8m0fnu, (256, 300), (256, 10)),
    "mxfp4": (torch.uint8, torch.float8_e8m0fnu, (256, 150), (256, 10)),
    "nvfp4": (torch.uint8, torch.float8_e4m3fn, (256, 150), (256, 19)),
    "int4_g32": (torch.uint8, torch.bfloat16, (256, 150), (256, 10)),
    "int4_g128": (torch.uint8, torch.bfloat16, (256, 150), (256, 3)),
}


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_output_dtypes_and_shapes(fmt: str) -> None:
    x = torch.randn(256, 300).to(torch.bfloat16)
    q = mq.quantize(x, fmt)
    data_dtype, scale_dtype, data_shape, scale_shape = EXPECTED[fmt]
    assert (q.data.dtype, q.scales.dtype) == (data_dtype, scale_dtype)
    assert tuple(q.data.shape) == data_shape
    assert tuple(q.scales.shape) == scale_shape
    assert q.shape == (256, 300)
    assert q.dtype == torch.bfloat16
    assert q.format == fmt
    assert (q.global_scale is not None) == (fmt == "nvfp4")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = mq.dequantize(q, dtype)
        assert out.dtype == dtype
        assert out.shape == x.shape
    # Relative error of a 4-bit or 8-bit format on Gaussian data.
    err = (mq.dequantize(q) - x.float()).norm() / x.float().norm()
    assert err < (0.2 if q.data.dtype == torch.uint8 else 0.1)


def test_granularity_scale_shapes() -> None:
    x = torch.randn(2, 3, 300)
    assert mq.quantize(x, "fp8_e4m3", granularity="channel").scales.shape == (2, 3, 1)
    assert mq.quantize(x, "fp8_e4m3", granularity="1x128").scales.shape == (2, 3, 3)
    assert mq.quantize(x, "fp8_e4m3", granularity="tensor").scales.shape == ()
    assert mq.quantize(x, "fp8_e4m3", stacked=True).scales.shape == (2,)
    assert mq.quantize(x, "fp8_block128").scales.shape == (2, 1, 3)
    q = mq.quantize(x, "nvfp4", stacked=True)
    assert q.global_scale is not None
    assert q.global_scale.shape == (2,)
    q2 = mq.quantize(torch.randn(40, 64), "nvfp4", granularity="16x16")
    s = q2.scales.view(torch.uint8)
    assert torch.equal(s[:16], s[:1].expand(16, -1))
    assert torch.equal(s[32:], s[32:33].expand(8, -1))


def test_non_contiguous_and_grad_inputs_are_accepted_and_not_modified() -> None:
    x = torch.randn(64, 128, requires_grad=True)
    xt = x.t()
    before = xt.detach().clone()
    q = mq.quantize(xt, "mxfp8_e4m3")
    assert torch.equal(xt.detach(), before)
    assert same_bits(q.data, mq.quantize(xt.detach().contiguous(), "mxfp8_e4m3").data)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"x": torch.randn(4, 32, dtype=torch.float64), "format": "mxfp4"}, "unsupported dtype"),
        ({"x": torch.ones(4, 32, dtype=torch.int32), "format": "fp8_e4m3"}, "unsupported dtype"),
        ({"x": torch.ones(4, 32, dtype=torch.bool), "format": "nvfp4"}, "unsupported dtype"),
        (
            {"x": torch.ones(4, 32).to(torch.float8_e4m3fn), "format": "mxfp8_e4m3"},
            "unsupported dtype",
        ),
        ({"x": torch.ones(4, 32, dtype=torch.complex64), "format": "int4_g32"}, "unsupported"),
        ({"x": torch.tensor(1.0), "format": "fp8_e4m3"}, "at least one dimension"),
        ({"x": torch.randn(32), "format": "fp8_block128"}, "needs \\[..., N, K\\]"),
        ({"x": torch.randn(2, 16, 32), "format": "nvfp4", "granularity": "16x16"}, "16x16"),
        ({"x": torch.randn(4, 32), "format": "fp4"}, "unknown format"),
        ({"x": torch.randn(4, 32), "format": "mxfp4", "granularity": "1x16"}, "granularities"),
        ({"x": torch.randn(4, 32), "format": "mxfp4", "scale_rule": "ceil"}, "scale_rule must be"),
        ({"x": torch.randn(4, 32), "format": "nvfp4", "scale_rule": "floor"}, "MX formats only"),
        (
            {"x": torch.randn(4, 32), "format": "mxfp4", "scale_dtype": torch.float32},
            "int4 formats only",
        ),
        (
            {"x": torch.randn(4, 32), "format": "int4_g32", "scale_dtype": torch.int8},
            "scale_dtype must be",
        ),
        ({"x": torch.randn(4, 32), "format": "int4_g32", "backend": "cuda"}, "backend must be"),
        ({"x": torch.randn(32), "format": "fp8_e4m3", "stacked": True}, "leading expert dim"),
        ({"x": [1.0, 2.0], "format": "fp8_e4m3"}, "expected a torch.Tensor"),
        ({"x": torch.randn(4, 32), "format": "nvfp4", "threads": 0}, "threads must be a positive"),
        ({"x": torch.randn(4, 32), "format": "nvfp4", "threads": -2}, "threads must be a positive"),
        (
            {"x": torch.randn(4, 32), "format": "mxfp4", "threads": 1.5},
            "threads must be a positive",
        ),
        (
            {"x": torch.randn(4, 32), "format": "mxfp4", "threads": True},
            "threads must be a positive",
        ),
    ],
)
def test_bad_input_raises_a_clear_value_error(kwargs: dict, message: str) -> None:
    x = kwargs.pop("x")
    fmt = kwargs.pop("format")
    with pytest.raises(ValueError, match=message):
        mq.quantize(x, fmt, **kwargs)


def test_native_backend_rejects_non_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="CPU and CUDA tensors only"):
        mq.quantize(torch.empty(4, 32, device="meta"), "mxfp4", backend="native")


def test_dequantize_rejects_other_dtypes() -> None:
    q = mq.quantize(torch.randn(4, 32), "mxfp4")
    with pytest.raises(ValueError, match="dtype must be"):
        mq.dequantize(q, torch.float64)


def test_dequantize_rejects_what_is_not_a_quantized_tensor() -> None:
    q = mq.quantize(torch.randn(4, 32), "nvfp4")
    with pytest.raises(ValueError, match="expected a QuantizedTensor"):
        mq.dequantize(q.data)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        mq.dequantize(dataclasses.replace(q, format="fp4"))
    with pytest.raises(ValueError, match="needs its global_scale"):
        mq.dequantize(dataclasses.replace(q, global_scale=None))


@pytest.mark.parametrize("fmt", sorted(mq.FORMATS))
@pytest.mark.parametrize("shape", [(0,), (0, 64), (5, 0), (3, 0, 64)])
def test_empty_tensors_have_the_scales_of_an_all_zero_tensor(
    fmt: str, shape: tuple[int, ...]
) -> None:
    # docs/contract.md section 1: a tensor-level scale of an empty tensor is that of an
    # all-zero group; block scales of an empty tensor are empty.
    if fmt == "fp8_block128" and len(shape) < 2:
        pytest.skip("fp8_block128 needs [..., N, K]")
    empty = mq.quantize(torch.empty(shape), fmt)
    zero = mq.quantize(torch.zeros(1, 256), fmt)
    assert empty.shape == shape
    assert mq.dequantize(empty, torch.bfloat16).shape == shape
    if fmt.startswith("fp8_e"):  # "tensor" granularity: one scale
        assert same_bits(empty.scales, zero.scales)
    else:
        assert empty.scales.numel() == 0
    if fmt == "nvfp4":
        assert empty.global_scale is not None
        assert zero.global_scale is not None
        assert same_bits(empty.global_scale, zero.global_scale)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
        check=False,
    )


def test_without_the_extension_import_works_warns_once_and_gives_the_same_bits() -> None:
    code = """
        import warnings, torch
        warnings.simplefilter("always")
        import miles_quant as mq
        assert not mq.native_available() and "MILES_QUANT_DISABLE_NATIVE" in mq.native_error()
        x = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = mq.quantize(x, "nvfp4")
            b = mq.quantize(x, "mxfp4")
        assert len(w) == 1 and "PyTorch reference" in str(w[0].message), [str(m.message) for m in w]
        try:
            mq.quantize(x, "nvfp4", backend="native")
        except RuntimeError as e:
            assert "unavailable" in str(e)
        else:
            raise AssertionError("backend='native' must fail without the extension")
        torch.save({"a": a.data, "b": b.data, "s": a.scales.view(torch.uint8)}, "OUT")
    """
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        r = _run(code.replace("OUT", out), MILES_QUANT_DISABLE_NATIVE="1")
        assert r.returncode == 0, r.stderr
        saved = torch.load(out)
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(saved["a"], mq.quantize(x, "nvfp4").data)
    assert torch.equal(saved["b"], mq.quantize(x, "mxfp4").data)
    assert torch.equal(saved["s"], mq.quantize(x, "nvfp4").scales.view(torch.uint8))


def test_import_and_quantize_load_no_cuda_library() -> None:
    code = """
        import torch, miles_quant as mq
        mq.quantize(torch.randn(8, 64), "mxfp8_e4m3")
        maps = open("/proc/self/maps").read()
        assert "libcuda." not in maps and "libcudart" not in maps, "a CUDA library was loaded"
        assert not torch.cuda.is_initialized()
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr


def test_layout_examples() -> None:
    # Element 0 in the low nibble.
    assert mq.pack_fp4(torch.tensor([0x1, 0xF, 0x7], dtype=torch.uint8)).tolist() == [0xF1, 0x07]
    # INT4: offset binary q + 8; as little-endian int32, compressed-tensors' pack-quantized word.
    q = torch.tensor([-8, -1, 0, 1, 2, 3, 7, -7], dtype=torch.int8)
    packed = mq.pack_int4(q)
    assert packed.tolist() == [0x70, 0x98, 0xBA, 0x1F]
    word = packed.view(torch.int32).item() & 0xFFFFFFFF
    want = sum((int(v) + 8) << (4 * i) for i, v in enumerate(q.tolist()))
    assert word == want
    with pytest.raises(ValueError, match="\\[-8, 7\\]"):
        mq.pack_int4(torch.tensor([8]))
    with pytest.raises(ValueError, match="cannot hold"):
        mq.unpack_fp4(torch.zeros(3, dtype=torch.uint8), 7)
    # A code that does not fit a nibble is refused, not masked to its low 4 bits.
    with pytest.raises(ValueError, match="\\[0, 15\\]"):
        mq.pack_fp4(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        mq.pack_fp4(torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match=">= 0"):
        mq.swizzle_offsets(-1, 4)
    with pytest.raises(ValueError, match="1-byte scales"):
        mq.unswizzle_scales(torch.zeros(128, 4), 5, 4)
    # Swizzle offsets of a 128x4 tile: (r % 32) * 16 + (r // 32) * 4 + c; tiles row-major.
    off = mq.swizzle_offsets(256, 8)
    assert off[0, 0] == 0
    assert off[1, 0] == 16
    assert off[32, 0] == 4
    assert off[0, 3] == 3
    assert off[33, 2] == 16 + 4 + 2
    assert off[0, 4] == 512
    assert off[128, 0] == 1024
