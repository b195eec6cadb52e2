"""quantize(..., out=q): the result goes into the buffers of an earlier result (no allocation,
no first-touch page faults in loops); the bits equal a fresh call; a mismatched `out` raises a
ValueError before anything is written."""

from __future__ import annotations

import pytest
import torch
from _quant_testlib import NATIVE_DISABLED, assert_same_quantized, bits, format_cases

import miles_quant as mq

CASES = format_cases()
IDS = [f"{f}-{g}-{r}" for f, g, r in CASES]
BACKENDS = ["torch"] if NATIVE_DISABLED else ["native", "torch"]


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stacked", [False, True])
def test_out_reuses_the_buffers_and_gives_the_same_bits(
    fmt: str, gran: str, rule: str | None, backend: str, stacked: bool
) -> None:
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(3, 48, 200, generator=g) * 5).to(torch.bfloat16)
    y = (torch.randn(3, 48, 200, generator=g) * 1e-3).to(torch.bfloat16)
    y[1, 3, 17] = float("nan")  # a poisoned group in the second call
    if gran == "16x16" and not stacked:
        x, y = x[0], y[0]
    kw = {"granularity": gran, "scale_rule": rule, "stacked": stacked, "backend": backend}
    q = mq.quantize(x, fmt, **kw)  # type: ignore[arg-type]
    ptrs = [t.data_ptr() for t in (q.data, q.scales, q.global_scale) if t is not None]
    q2 = mq.quantize(y, fmt, out=q, **kw)  # type: ignore[arg-type]
    assert [t.data_ptr() for t in (q2.data, q2.scales, q2.global_scale) if t is not None] == ptrs
    assert_same_quantized(q2, mq.quantize(y, fmt, **kw))  # type: ignore[arg-type]
    # out's own tensors hold the new result too (the buffers were overwritten in place).
    assert torch.equal(bits(q.data), bits(q2.data))
    assert torch.equal(bits(q.scales), bits(q2.scales))


def _mismatched() -> list[tuple[str, dict[str, object], str]]:
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    q = mq.quantize(x, "mxfp4")
    bad_data = mq.QuantizedTensor(
        torch.empty(16, 31, dtype=torch.uint8), q.scales, "mxfp4", q.shape, q.dtype, "1x32",
        "floor",
    )  # fmt: skip
    strided = mq.QuantizedTensor(
        torch.empty(16, 64, dtype=torch.uint8)[:, ::2], q.scales, "mxfp4", q.shape, q.dtype,
        "1x32", "floor",
    )  # fmt: skip
    no_global = mq.QuantizedTensor(
        q.data, torch.empty(16, 4, dtype=torch.float8_e4m3fn), "nvfp4", q.shape, q.dtype, "1x16"
    )
    on_meta = mq.QuantizedTensor(
        q.data.to("meta"), q.scales.to("meta"), "mxfp4", q.shape, q.dtype, "1x32", "floor"
    )
    return [
        ("mxfp4", {"out": mq.quantize(x, "nvfp4")}, "different quantization"),
        ("mxfp4", {"out": mq.quantize(x.float(), "mxfp4")}, "different quantization"),
        ("mxfp4", {"out": mq.quantize(x[:8], "mxfp4")}, "different quantization"),
        ("mxfp4", {"out": q, "scale_rule": "rceil"}, "different quantization"),
        ("mxfp4", {"out": bad_data}, "out.data must be"),
        ("mxfp4", {"out": strided}, "contiguous"),
        ("nvfp4", {"out": no_global}, "out.global_scale must be"),
        ("int4_g32", {"out": mq.quantize(x, "int4_g32", scale_dtype=torch.float32)}, "scales"),
        ("mxfp4", {"out": (q.data, q.scales)}, "must be a QuantizedTensor"),
        ("mxfp4", {"out": on_meta}, "contiguous and on cpu"),
    ]


@pytest.mark.parametrize(("fmt", "kwargs", "message"), _mismatched())
def test_a_mismatched_out_raises_and_writes_nothing(
    fmt: str, kwargs: dict[str, object], message: str
) -> None:
    out = kwargs["out"]
    # Meta tensors hold no bits to compare (and cannot be written either).
    real = out if isinstance(out, mq.QuantizedTensor) and out.data.device.type != "meta" else None
    before = [bits(t).clone() for t in (real.data, real.scales)] if real is not None else []
    x = torch.randn(16, 64, dtype=torch.bfloat16) * 100
    with pytest.raises(ValueError, match=message):
        mq.quantize(x, fmt, **kwargs)  # type: ignore[arg-type]
    if real is not None:
        assert all(
            torch.equal(b, bits(t)) for b, t in zip(before, (real.data, real.scales), strict=True)
        )
