"""The CUDA kernels (native/quant/cuda): compiled with nvcc wherever it exists (the kernels
alone, and the whole package with MILES_QUANT_CUDA=ON); run against the reference only on a GPU
(marked `gpu`), in a build with -Ccmake.define.MILES_QUANT_CUDA=ON. On a lent GPU machine,
tools/gpu_checks/quant_cuda_check.sh does that build and runs these tests."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest
import torch
from _quant_testlib import assert_same_quantized, format_cases

import miles_quant as mq

NATIVE = Path(__file__).resolve().parents[3] / "native" / "quant"
CASES = format_cases()


NO_NVCC = "nvcc not on PATH: the CUDA kernels are compiled only where the CUDA toolkit is installed"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason=NO_NVCC)
def test_cuda_kernels_compile_with_the_contract_flags(tmp_path: Path) -> None:
    src = NATIVE / "cuda" / "quantize.cu"
    assert src.exists(), src
    r = subprocess.run(
        [
            "nvcc", "-std=c++17", "-O2", "-fmad=false", "-prec-div=true", "-prec-sqrt=true",
            "-ftz=false", f"-I{NATIVE / 'include'}", "-gencode", "arch=compute_90,code=sm_90",
            "-Werror", "all-warnings", "-c", str(src), "-o", str(tmp_path / "quantize.o"),
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "quantize.o").stat().st_size > 0


@pytest.mark.slow  # 40-70 s: the whole package with the CUDA kernels for sm_90 and sm_100
@pytest.mark.skipif(shutil.which("nvcc") is None, reason=NO_NVCC)
def test_package_builds_with_the_cuda_kernels(tmp_path: Path) -> None:
    # What `pip install packages/miles-quant -Ccmake.define.MILES_QUANT_CUDA=ON` builds: the
    # CMake CUDA setup, the kernels, the nanobind binding and the link against cudart.
    pkg = Path(__file__).resolve().parents[1]
    # A fresh venv's pip builds the wheel: the test runner's interpreter may have no pip (Pants).
    venv.EnvBuilder(with_pip=True).create(tmp_path / "v")
    r = subprocess.run(
        [
            str(tmp_path / "v" / "bin" / "python"), "-m", "pip", "wheel", "-q", "--no-deps",
            f"-Cbuild-dir={tmp_path / 'b'}",
            "-Ccmake.define.MILES_QUANT_CUDA=ON", "-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90;100",
            "-w", str(tmp_path / "w"), str(pkg),
        ],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    (wheel,) = (tmp_path / "w").glob("miles_quant-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (cuda_so,) = [n for n in names if n.startswith("miles_quant/_ext_cuda.")]
        assert [n for n in names if n.startswith("miles_quant/_ext.")]
        z.extract(cuda_so, tmp_path / "x")
    # The module loads without a GPU or driver (CUDA is touched only when a kernel runs).
    spec = importlib.util.spec_from_file_location("miles_quant._ext_cuda", tmp_path / "x" / cuda_so)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for op in ("quantize_fp8", "quantize_mx", "quantize_nvfp4", "quantize_int4"):
        assert callable(getattr(mod, op))
    _native_calls_match_the_cuda_binding(mod)


def _native_calls_match_the_cuda_binding(mod: object) -> None:
    """miles_quant._native calls the CUDA binding with the CPU binding's arguments (the stream in
    place of the threads). Without a GPU the kernels cannot run, but the binding checks every
    buffer's size before it launches: each wrapper, pointed at `mod`, with a data buffer one byte
    short must raise that size check's ValueError, not a TypeError from a signature mismatch."""
    from miles_quant import _native
    from miles_quant._spec import FORMATS

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    short = torch.empty(4 * 64 - 1, dtype=torch.uint8)  # too small for every layout below
    f32, u8 = torch.empty(64, dtype=torch.float32), torch.empty(512, dtype=torch.uint8)
    one = torch.empty(1, dtype=torch.uint8)
    e4m3, e2m1 = FORMATS["fp8_e4m3"].element, FORMATS["mxfp4"].element
    assert e4m3 is not None
    assert e2m1 is not None
    calls = {
        "quantize_fp8": lambda: _native.fp8(x, (1, 4, 64), e4m3, (1, 128), False, short, f32),
        "quantize_mx": lambda: _native.mx(x, 4, e4m3, "floor", short, u8),
        "quantize_nvfp4": lambda: _native.nvfp4(x, (1, 4, 64), False, one, u8, f32[:1], False),
        "quantize_int4": lambda: _native.int4(x, 4, 32, one, f32),
    }  # fmt: skip
    saved = _native._mod
    _native._mod = lambda _x, _threads: (mod, 0)  # type: ignore[assignment]
    try:
        for op, call in calls.items():
            with pytest.raises(ValueError, match=f"_ext_cuda: {op}: out size"):
                call()
    finally:
        _native._mod = saved  # type: ignore[assignment]


def _on_device_equals_reference(
    device: str,
    fmt: str,
    gran: str,
    rule: str | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    backend: str = "native",
) -> None:
    """`backend` (the native kernels, or the torch reference) on `device` against the torch
    reference on CPU, bit for bit."""
    stacked = len(shape) == 3  # [E, N, K]: per-expert tensor-level scales
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    x.view(-1, shape[-1])[3, 5] = float("nan")  # in the first matrix (expert) only
    x[..., shape[-2] * 2 // 3 : shape[-2] * 2 // 3 + 20, :] = 0  # all-zero groups and tiles
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    kw = {"granularity": gran, "scale_rule": rule, "stacked": stacked}
    ref = mq.quantize(x, fmt, backend="torch", **kw)  # type: ignore[arg-type]
    got = mq.quantize(x.to(device), fmt, backend=backend, **kw)  # type: ignore[arg-type]
    if device == "cuda":
        torch.cuda.synchronize()
    cpu = mq.QuantizedTensor(
        data=got.data.cpu(),
        scales=got.scales.cpu(),
        format=got.format,
        shape=got.shape,
        dtype=got.dtype,
        granularity=got.granularity,
        scale_rule=got.scale_rule,
        global_scale=None if got.global_scale is None else got.global_scale.cpu(),
        stacked=got.stacked,
    )
    assert_same_quantized(cpu, ref)
    if backend != "native":
        return
    # out= on the device: the kernels write into the earlier result's buffers, same bits.
    again = mq.quantize(x.to(device), fmt, backend="native", out=got, **kw)  # type: ignore[arg-type]
    assert again.data.data_ptr() == got.data.data_ptr()
    assert torch.equal(again.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))


# 2-D with a partial 1x128 group and K a multiple of 8 (the vectorized kernels); stacked experts
# with an odd K (the scalar kernels: a pad nibble in packed rows, partial blocks of every size)
# and N not a multiple of 16 or 128; stacked experts with K a multiple of 8 (vectorized, each
# expert's own tensor-level scale; the NaN poisons expert 0 only).
SHAPES = [(300, 544), (3, 40, 97), (2, 72, 160)]
SHAPE_IDS = ["2d", "stacked", "stacked-vec"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=[f"{f}-{g}-{r}" for f, g, r in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_equals_reference(
    fmt: str, gran: str, rule: str | None, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    _on_device_equals_reference("cuda", fmt, gran, rule, dtype, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=[f"{f}-{g}-{r}" for f, g, r in CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_reference_backend_equals_cpu_reference(
    fmt: str, gran: str, rule: str | None, shape: tuple[int, ...]
) -> None:
    # The torch reference on CUDA tensors (what QAT's fake quantization runs on a GPU): its
    # divisions must not become multiplications by a reciprocal (test_reference_divisions.py).
    _on_device_equals_reference("cuda", fmt, gran, rule, torch.bfloat16, shape, backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gran", ["1x16", "16x16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_nvfp4_with_a_given_global_scale_equals_reference(
    gran: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    _given_scale_on_device_equals_reference("cuda", gran, dtype, shape)


def _given_scale_on_device_equals_reference(
    device: str, gran: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    # No amax kernel then; a NaN or an Inf poisons its block alone, values beyond 2688 * s
    # saturate.
    stacked = len(shape) == 3
    if gran == "16x16" and shape[-2] % 16:
        pytest.skip("16x16 tiles need N % 16 == 0 here")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    x = x.clamp(-60000, 60000)
    x.view(-1, shape[-1])[3, 5] = float("nan")
    x.view(-1, shape[-1])[37, 40] = float("-inf")
    x = x.to(dtype)
    scales = [torch.tensor(0.0123), torch.tensor(1.0)]
    if stacked:
        scales.append(torch.linspace(0.01, 3.0, shape[0]))
    for s in scales:
        kw = {"granularity": gran, "stacked": stacked, "global_scale": s}
        ref = mq.quantize(x, "nvfp4", backend="torch", **kw)  # type: ignore[arg-type]
        got = mq.quantize(x.to(device), "nvfp4", backend="native", **kw)  # type: ignore[arg-type]
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(got.data.cpu(), ref.data)
        assert torch.equal(got.scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8))
        assert torch.equal(got.global_scale.cpu(), ref.global_scale)


def _to_cuda(q: mq.QuantizedTensor) -> mq.QuantizedTensor:
    g = None if q.global_scale is None else q.global_scale.cuda()
    return mq.QuantizedTensor(
        q.data.cuda(), q.scales.cuda(), q.format, q.shape, q.dtype, q.granularity,
        q.scale_rule, g, q.stacked,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dequantize_equals_cpu_bits() -> None:
    # dequantize of CUDA tensors runs torch ops there (no CUDA dequantize kernel); its products,
    # roundings and canonical NaNs must be the CPU kernels' bits (test_dequantize.py's grid:
    # every code against every scale code and edge scales, subnormal and overflowing products).
    from test_dequantize import OUT_DTYPES, _grid_cases

    for q in _grid_cases():
        dev = _to_cuda(q)
        for dtype in OUT_DTYPES:
            got = mq.dequantize(dev, dtype)
            assert got.device.type == "cuda"
            want = mq.dequantize(q, dtype)
            size = {torch.float32: torch.int32}.get(dtype, torch.int16)
            assert torch.equal(got.cpu().view(size), want.view(size)), (q.format, dtype)
