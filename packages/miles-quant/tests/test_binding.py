"""miles_quant._ext, the binding: it takes each buffer as (address, size in bytes) and checks every
size against the call's shape before a kernel runs, so a wrong call from the Python wrapper raises
ValueError naming the buffer instead of writing out of bounds (it skips DLPack, which cost more
than a small call's work: docs/benchmarks.md, "the cost of a small call")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from _quant_testlib import assert_same_quantized, bits, format_cases, require_native

import miles_quant as mq
from miles_quant import _native


@pytest.fixture(autouse=True)
def _native_only() -> None:
    require_native()


def _buf(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.nbytes


@dataclass
class Call:
    """A valid call of one kernel on a bf16 [4, 64] input and the quantize() it stands for."""

    fn: Callable[..., None]
    args: list[object]  # holds the addresses of `bufs`, which keep them alive
    bufs: dict[str, torch.Tensor]  # by name, in the call's order: x, out, scales[, global_scale]
    want: mq.QuantizedTensor  # the same quantization by quantize()

    def size_pos(self, name: str) -> int:
        """Where `name`'s size sits in args (its address just before)."""
        return self.args.index(self.bufs[name].data_ptr()) + 1


def _call(kernel: str) -> Call:
    ext = _native._ext
    assert ext is not None
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    if kernel == "quantize_fp8":  # 1x128 groups: one per row of 64
        b = {"x": x, "out": torch.empty(256, dtype=torch.uint8), "scales": torch.empty(4)}
        args = [*_buf(x), 1, 1, 4, 64, 1, 128, False, 0, *_buf(b["out"]), *_buf(b["scales"]), 1]
        return Call(ext.quantize_fp8, args, b, mq.quantize(x, "fp8_e4m3", granularity="1x128"))
    if kernel == "quantize_mx":  # MXFP8 E4M3, FLOOR
        b = {"x": x, "out": torch.empty(256, dtype=torch.uint8),
             "scales": torch.empty(8, dtype=torch.uint8)}  # fmt: skip
        args = [*_buf(x), 1, 4, 64, 0, 0, *_buf(b["out"]), *_buf(b["scales"]), 1]
        return Call(ext.quantize_mx, args, b, mq.quantize(x, "mxfp8_e4m3"))
    if kernel == "quantize_nvfp4":  # 1x16, computed global scale
        b = {"x": x, "out": torch.empty(128, dtype=torch.uint8),
             "scales": torch.empty(16, dtype=torch.uint8),
             "global_scale": torch.empty(1)}  # fmt: skip
        args = [*_buf(x), 1, 1, 4, 64, False, *_buf(b["out"]), *_buf(b["scales"]),
                *_buf(b["global_scale"]), 1, False]  # fmt: skip
        return Call(ext.quantize_nvfp4, args, b, mq.quantize(x, "nvfp4"))
    assert kernel == "quantize_int4"  # groups of 32, bf16 scales
    b = {"x": x, "out": torch.empty(128, dtype=torch.uint8),
         "scales": torch.empty(8, dtype=torch.bfloat16)}  # fmt: skip
    args = [*_buf(x), 1, 4, 64, 32, 1, *_buf(b["out"]), *_buf(b["scales"]), 1]
    return Call(ext.quantize_int4, args, b, mq.quantize(x, "int4_g32"))


KERNELS = ["quantize_fp8", "quantize_mx", "quantize_nvfp4", "quantize_int4"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_valid_call_writes_quantizes_bits(kernel: str) -> None:
    c = _call(kernel)
    c.fn(*c.args)
    assert torch.equal(bits(c.bufs["out"]), bits(c.want.data))
    assert torch.equal(bits(c.bufs["scales"]), bits(c.want.scales))
    if c.want.global_scale is not None:
        assert torch.equal(bits(c.bufs["global_scale"]), bits(c.want.global_scale))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("delta", [-1, 1])
def test_every_buffer_size_is_checked(kernel: str, delta: int) -> None:
    c = _call(kernel)
    for name in c.bufs:
        bad = list(c.args)
        bad[c.size_pos(name)] = c.bufs[name].nbytes + delta
        with pytest.raises(ValueError, match=f"{kernel}: {name} size"):
            c.fn(*bad)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_null_address_with_a_size_is_refused(kernel: str) -> None:
    c = _call(kernel)
    for name in c.bufs:
        bad = list(c.args)
        bad[c.size_pos(name) - 1] = 0
        with pytest.raises(ValueError, match=f"{kernel}: {name}"):
            c.fn(*bad)


def test_a_refused_call_writes_nothing() -> None:
    c = _call("quantize_mx")
    c.bufs["out"].fill_(0xAB)
    bad = list(c.args)
    bad[c.size_pos("scales")] = c.bufs["scales"].nbytes - 1
    with pytest.raises(ValueError, match="scales size"):
        c.fn(*bad)
    assert bool((c.bufs["out"] == 0xAB).all())


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


def test_the_raw_cast_checks_its_sizes() -> None:
    ext = _native._ext
    assert ext is not None
    x, out = torch.tensor([1.0, -0.5, 448.0]), torch.empty(3, dtype=torch.uint8)
    ext.encode(*_buf(x), 0, *_buf(out), 1)  # E4M3
    assert out.tolist() == [0x38, 0xB0, 0x7E]
    with pytest.raises(ValueError, match="encode: x must be float32"):
        ext.encode(x.data_ptr(), 6, 0, *_buf(out), 1)
    with pytest.raises(ValueError, match="encode: out"):
        ext.encode(*_buf(x), 0, out.data_ptr(), 2, 1)
