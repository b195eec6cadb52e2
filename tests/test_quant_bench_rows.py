"""The quantizer benches time what their row labels say.

tools/bench/quant_bandwidth.py (CPU) and tools/bench/quant_cuda_bandwidth.py (GPU) share one
list of rows. Each row's timed native call must give the bits of a plain quantize() call, and a
"static" NVFP4 row must hand quantize() the global scale (no amax pass), for both benches: the
GPU bench once timed its static row as the dynamic call under the static label. The GPU bench's
rows are built here on CPU tensors (its native method is `backend="native"` on whatever device
the input is on); only the timing needs a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import miles_quant as mq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import quant_bandwidth as cpu_bench
import quant_cuda_bandwidth as gpu_bench
import quant_dequant as dequant_bench


def _assert_same(a: mq.QuantizedTensor, b: mq.QuantizedTensor) -> None:
    for u, v in ((a.data, b.data), (a.scales, b.scales), (a.global_scale, b.global_scale)):
        assert (u is None) == (v is None)
        if v is not None:  # bits, so that equal NaN scales compare equal too
            assert torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


def _native(methods: list[cpu_bench.Method]) -> cpu_bench.Method:
    return next(m for m in methods if m.name == "native")


@pytest.mark.parametrize("shape", [(128, 512), (2, 64, 512)])
@pytest.mark.parametrize("bench", ["cpu", "gpu"])
@pytest.mark.parametrize("row", cpu_bench.FORMATS, ids=[r[0] for r in cpu_bench.FORMATS])
def test_bench_row_times_what_its_label_says(
    row: tuple[str, str, str, str | None], bench: str, shape: tuple[int, ...]
) -> None:
    label, fmt, gran, rule = row
    if not mq.native_available():
        pytest.skip("the benches time the native kernels; this build has none")
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    if bench == "cpu":
        methods = cpu_bench.methods_for(x, label, fmt, gran, rule, [1], False)
    else:
        methods = gpu_bench.methods_for(x, label, fmt, gran, rule)
    native = _native(methods)
    stacked = x.dim() == 3 and gran in ("tensor", "1x16", "16x16")
    expected = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, stacked=stacked)
    got = native.fn()
    assert isinstance(got, mq.QuantizedTensor)
    _assert_same(got, expected)
    keywords = native.fn.keywords  # type: ignore[attr-defined]
    if label.endswith("static"):
        assert torch.equal(keywords["global_scale"], expected.global_scale)
    else:
        assert "global_scale" not in keywords


def test_a_static_row_of_another_format_is_refused() -> None:
    x = torch.ones(16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs format 'nvfp4'"):
        cpu_bench.native_call(x, "mxfp4 static", "mxfp4", "1x32", "floor")


@pytest.mark.parametrize("row", cpu_bench.FORMATS, ids=[r[0] for r in cpu_bench.FORMATS])
def test_fp16_bench_rows_time_fp16_inputs(row: tuple[str, str, str, str | None]) -> None:
    # `quant_bandwidth.py --dtype fp16`: the native row quantizes the fp16 input itself (fp16 has
    # paths of its own: FP8 by its tables, MX on 16-bit lanes), and every peer it lists runs on it.
    label, fmt, gran, rule = row
    if not mq.native_available():
        pytest.skip("the benches time the native kernels; this build has none")
    x = (torch.randn(128, 512, generator=torch.Generator().manual_seed(1)) * 3).to(torch.float16)
    methods = cpu_bench.methods_for(x, label, fmt, gran, rule, [1], False)
    got = _native(methods).fn()
    assert isinstance(got, mq.QuantizedTensor)
    assert got.dtype == torch.float16
    _assert_same(got, mq.quantize(x, fmt, granularity=gran, scale_rule=rule))
    if gran == "16x16":  # torchao and ModelOpt quantize 1x16 blocks only: no peer for 16x16
        assert {m.name for m in methods} == {"native"}
    for m in methods:
        m.fn()  # torchao eager refuses fp16 and is left out; the casts read fp16
    assert not any(m.name == "torchao eager" for m in methods)


@pytest.mark.parametrize("row", cpu_bench.FORMATS, ids=[r[0] for r in cpu_bench.FORMATS])
def test_fp32_bench_rows_time_fp32_inputs(row: tuple[str, str, str, str | None]) -> None:
    # `quant_bandwidth.py --dtype fp32`: the native row quantizes the fp32 input (no cast to a
    # 16-bit dtype first), the ml_dtypes cast reads the same fp32 array, and torchao (which takes
    # fp32) runs on it wherever it has the format.
    label, fmt, gran, rule = row
    if not mq.native_available():
        pytest.skip("the benches time the native kernels; this build has none")
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(2)) * 3
    methods = cpu_bench.methods_for(x, label, fmt, gran, rule, [1], False)
    got = _native(methods).fn()
    assert isinstance(got, mq.QuantizedTensor)
    assert got.dtype == torch.float32
    _assert_same(got, mq.quantize(x, fmt, granularity=gran, scale_rule=rule))
    for m in methods:
        m.fn()
    names = {m.name for m in methods}
    if importlib.util.find_spec("ml_dtypes") is not None and fmt.startswith(("fp8", "mx")):
        assert "ml_dtypes cast" in names
    if cpu_bench._torchao() is not None and mq.FORMATS[fmt].family in ("mx", "nvfp4"):
        assert ("torchao eager" in names) == (gran != "16x16")


@pytest.mark.parametrize("shape", [(128, 512), (2, 64, 512)])
@pytest.mark.parametrize("row", dequant_bench.ROWS, ids=[r[0] for r in dequant_bench.ROWS])
def test_dequant_bench_rows_time_what_their_labels_say(
    row: tuple[str, str, str, str | None], shape: tuple[int, ...]
) -> None:
    # tools/bench/quant_dequant.py: the native row dequantizes a quantize() result of its format
    # into its out= buffer with the bits of the reference, and every peer it lists runs.
    _, fmt, gran, rule = row
    if not mq.native_available():
        pytest.skip("the bench times the native kernels; this build has none")
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    methods = dequant_bench.methods_for(x, fmt, gran, rule, torch.bfloat16, [1])
    native = _native(methods)
    got = native.fn()
    q = native.fn.args[0]  # type: ignore[attr-defined]
    assert isinstance(q, mq.QuantizedTensor)
    assert (q.format, q.granularity) == (fmt, gran)
    want = mq.dequantize(q, torch.bfloat16, backend="torch")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for m in methods:
        m.fn()
    names = {m.name for m in methods}
    assert "reference" in names
    assert ("torch cast" in names) == (q.data.dtype != torch.uint8)  # FP8 codes only
    if cpu_bench._torchao() is not None:
        assert ("torchao eager" in names) == (
            fmt in ("mxfp8_e4m3", "mxfp4", "nvfp4") and gran != "16x16"
        )
