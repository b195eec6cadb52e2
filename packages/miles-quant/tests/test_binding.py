"""miles_quant._ext, the binding: it takes each buffer as (address, size in bytes) and checks every
size against the call's shape before a kernel runs, so a wrong call from the Python wrapper raises
ValueError naming the buffer instead of writing out of bounds (it skips DLPack, which cost more
than a small call's work: docs/benchmarks.md, "the cost of a small call")."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _quant_testlib import assert_same_quantized, format_cases, require_native

import miles_quant as mq
from miles_quant import _native


@pytest.fixture(autouse=True)
def _native_only() -> None:
    require_native()


def _buf(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.nbytes


def _calls() -> dict[str, tuple[Callable[..., None], list[object], list[int]]]:
    """kernel -> (function, the arguments of a valid call on a bf16 [4, 64] input, the positions
    of the size arguments, one per buffer in order: x, out, scales[, global_scale])."""
    ext = _native._ext
    assert ext is not None
    x = torch.randn(4, 64).to(torch.bfloat16)
    u8 = torch.empty(256, dtype=torch.uint8)
    f32 = torch.empty(4, dtype=torch.float32)
    sc = torch.empty(8, dtype=torch.uint8)
    bf = torch.empty(8, dtype=torch.bfloat16)
    # fp8 1x32 tiles (4 x 2 scales), mx e4m3 (4 x 2 scales), nvfp4 1x16 (4 x 4 scales, packed
    # 4 x 32 bytes), int4 groups of 32 with bf16 scales (4 x 2).
    f8s = torch.empty(8, dtype=torch.float32)
    nvs = torch.empty(16, dtype=torch.uint8)
    g = torch.empty(1, dtype=torch.float32)
    half = torch.empty(128, dtype=torch.uint8)
    return {
        "quantize_fp8": (
            ext.quantize_fp8,
            [*_buf(x), 1, 1, 4, 64, 1, 32, False, 0, *_buf(u8), *_buf(f8s), 1],
            [1, 11, 13],
        ),
        "quantize_mx": (
            ext.quantize_mx,
            [*_buf(x), 1, 4, 64, 0, 0, *_buf(u8), *_buf(sc), 1],
            [1, 8, 10],
        ),
        "quantize_nvfp4": (
            ext.quantize_nvfp4,
            [*_buf(x), 1, 1, 4, 64, False, *_buf(half), *_buf(nvs), *_buf(g), 1, False],
            [1, 8, 10, 12],
        ),
        "quantize_int4": (
            ext.quantize_int4,
            [*_buf(x), 1, 4, 64, 32, 1, *_buf(half), *_buf(bf), 1],
            [1, 8, 10],
        ),
        # Keep the buffers alive with the addresses (the dict holds the tensors too).
        "_alive": (lambda: None, [x, u8, f32, sc, bf, f8s, nvs, g, half], []),
    }


KERNELS = ["quantize_fp8", "quantize_mx", "quantize_nvfp4", "quantize_int4"]
BUFFERS = {
    "quantize_fp8": ["x", "out", "scales"],
    "quantize_mx": ["x", "out", "scales"],
    "quantize_nvfp4": ["x", "out", "scales", "global_scale"],
    "quantize_int4": ["x", "out", "scales"],
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_valid_call_runs(kernel: str) -> None:
    calls = _calls()
    fn, args, _ = calls[kernel]
    fn(*args)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("delta", [-1, 1])
def test_every_buffer_size_is_checked(kernel: str, delta: int) -> None:
    calls = _calls()
    fn, args, sizes = calls[kernel]
    for pos, name in zip(sizes, BUFFERS[kernel], strict=True):
        bad = list(args)
        bad[pos] = int(bad[pos]) + delta  # type: ignore[call-overload]
        with pytest.raises(ValueError, match=f"{kernel}: {name} size"):
            fn(*bad)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_null_address_with_a_size_is_refused(kernel: str) -> None:
    calls = _calls()
    fn, args, sizes = calls[kernel]
    for pos, name in zip(sizes, BUFFERS[kernel], strict=True):
        bad = list(args)
        bad[pos - 1] = 0
        with pytest.raises(ValueError, match=f"{kernel}: {name}"):
            fn(*bad)


def test_a_refused_call_writes_nothing() -> None:
    calls = _calls()
    fn, args, sizes = calls["quantize_mx"]
    out = calls["_alive"][1][1]
    assert isinstance(out, torch.Tensor)
    out.fill_(0xAB)
    bad = list(args)
    bad[sizes[2]] = int(bad[sizes[2]]) - 1  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="scales size"):
        fn(*bad)
    assert bool((out == 0xAB).all())


@pytest.mark.parametrize(("fmt", "gran", "rule"), format_cases())
@pytest.mark.parametrize("shape", [(5, 0), (0, 64), (3, 0, 64)])
def test_empty_inputs_of_every_granularity_match_the_reference_and_take_out(
    fmt: str, gran: str, rule: str | None, shape: tuple[int, ...]
) -> None:
    # The native path allocates the result in the layout quantize returns (the out= layout):
    # a K = 0 "channel" input has no scale groups (an earlier layout said one per row).
    if gran == "16x16" and len(shape) != 2:
        pytest.skip("16x16 takes [N, K]")
    x = torch.zeros(shape, dtype=torch.bfloat16)
    kw = {"granularity": gran, "scale_rule": rule}
    q = mq.quantize(x, fmt, backend="native", **kw)  # type: ignore[arg-type]
    assert_same_quantized(q, mq.quantize(x, fmt, backend="torch", **kw))  # type: ignore[arg-type]
    assert_same_quantized(mq.quantize(x, fmt, out=q, **kw), q)  # type: ignore[arg-type]
