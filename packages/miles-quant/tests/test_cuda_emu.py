"""The CUDA kernels (native/quant/cuda/quantize.cu), as written, on the CPU emulator
(native/quant/cuda/emu): compiled by g++, each CUDA thread a fiber, shuffles and __syncthreads as
barriers the emulator checks, behind the CUDA binding's own calls (bindings/cuda_calls.h). The
kernels then run on every machine, not only where a GPU is lent: the inputs test_isa.py gives
every CPU build (every bf16 and fp16 pattern, as elements and as block amaxes, odd shapes) and
test_cuda.py's GPU cases, against the CPU kernels and the reference, bit for bit.

This checks the kernels' logic: indexing, group and tile reductions, the vectorized and scalar
paths and their choice, the contract arithmetic they call, the binding's argument mapping and
size checks. It does not check nvcc's code generation (test_cuda.py compiles the kernels), the
hardware FP8 conversion of sm_89+ (compiled out here; checked on an H200 over all 2^32 inputs by
tools/bench/quant_cuda_cvt_probe.cu), races between blocks, or speed: those need a GPU
(tools/gpu_checks/quant_cuda_check.sh)."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from _cuda_emu import FLAGS, NATIVE, WARNINGS, EmulatedCudaModule, asan_runtime, build, compiler
from _quant_testlib import assert_same_quantized, format_cases, require_native
from test_cuda import (
    SHAPE_IDS,
    SHAPES,
    _given_scale_on_device_equals_reference,
    _native_calls_match_the_cuda_binding,
    _on_device_equals_reference,
)
from test_isa import CASES as ISA_CASES
from test_isa import N_INPUTS, _inputs, against_reference

import miles_quant as mq
from miles_quant import _native

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs g++ on Linux (the emulator)")
CASES = format_cases()
INPUTS = functools.cache(_inputs)  # built on first use, not at collection
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TILE_SHAPES = [(64, 200), (70, 200), (3, 40, 72), (16, 8)]
MISALIGNED_DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> EmulatedCudaModule:
    require_native()  # miles_quant.quantize(backend="native") needs the CPU extension loaded
    return EmulatedCudaModule(build(tmp_path_factory.mktemp("cuda_emu")))


@contextmanager
def on_emulator(emu: EmulatedCudaModule) -> Iterator[None]:
    """miles_quant._native calls the emulated CUDA binding (CPU tensors' addresses stand for
    device addresses), as test_cuda.py points it at a built _ext_cuda."""
    saved = _native._mod
    _native._mod = lambda _x, _threads: (emu, 0)  # type: ignore[assignment]
    try:
        yield
    finally:
        _native._mod = saved  # type: ignore[assignment]


def test_emulator_self_checks(tmp_path: Path) -> None:
    # The CUDA semantics the kernels rely on (xor shuffles over segments of a warp, __syncthreads
    # with shared memory, 2-D grids, atomicMax, threads that returned passing a barrier) against
    # plain loops, and the undefined behaviour the emulator must refuse: a shuffle waiting on a
    # lane that returned, a warp split between a shuffle and __syncthreads, a block too large.
    exe = tmp_path / "selftest"
    src = NATIVE / "cuda" / "emu" / "selftest.cpp"
    flags = [f for f in FLAGS if f not in ("-fPIC", "-shared")]
    cxx = compiler()
    assert cxx is not None
    r = subprocess.run(
        [cxx, *flags, *WARNINGS, f"-I{NATIVE / 'cuda' / 'emu'}", str(src), "-o", str(exe)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    names = {line.split()[0] for line in lines if line.split()[1] == "ok"}
    assert {
        "shuffle_xor_segments_of_4", "shuffle_xor_whole_warps", "syncthreads_block_sum_2d_grid",
        "returned_threads_pass_syncthreads", "atomic_max", "refuses_shuffle_with_returned_lanes",
        "refuses_divergent_barriers", "refuses_blocks_over_1024_threads",
    } <= names, r.stdout  # fmt: skip


@pytest.mark.parametrize("i", range(N_INPUTS))
def test_emulated_cuda_equals_the_cpu_kernels_on_every_pattern(
    emu: EmulatedCudaModule, i: int
) -> None:
    # test_isa.py's inputs through every case: the CPU kernels agree with the reference on these
    # (test_isa.py, test_formats.py); the narrow rows and odd shapes are also checked against the
    # reference here, as test_isa.py does for each CPU build.
    check_every_pattern(emu, i)


def check_every_pattern(emu: EmulatedCudaModule, i: int) -> None:
    x = INPUTS()[i]
    for fmt, gran, rule, sd in ISA_CASES:
        if gran == "16x16" and x.shape[0] % 16:
            continue
        kw = {"granularity": gran, "scale_rule": rule, "scale_dtype": sd}
        cpu = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
        with on_emulator(emu):
            got = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
        assert_same_quantized(got, cpu)
        if against_reference(i):
            assert_same_quantized(got, mq.quantize(x, fmt, **kw, backend="torch"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=[f"{f}-{g}-{r}" for f, g, r in CASES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_emulated_cuda_equals_reference(
    emu: EmulatedCudaModule,
    fmt: str,
    gran: str,
    rule: str | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> None:
    # test_cuda.py's GPU cases (vectorized 2-D, scalar stacked with odd K, vectorized stacked),
    # with out= writing into the first result's buffers.
    check_reference(emu, fmt, gran, rule, dtype, shape)


def check_reference(
    emu: EmulatedCudaModule,
    fmt: str,
    gran: str,
    rule: str | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> None:
    with on_emulator(emu):
        _on_device_equals_reference("cpu", fmt, gran, rule, dtype, shape)


@pytest.mark.parametrize("gran", ["1x16", "16x16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_emulated_cuda_nvfp4_with_a_given_global_scale_equals_reference(
    emu: EmulatedCudaModule, gran: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    check_given_scale(emu, gran, dtype, shape)


def check_given_scale(
    emu: EmulatedCudaModule, gran: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    with on_emulator(emu):
        _given_scale_on_device_equals_reference("cpu", gran, dtype, shape)


@pytest.mark.parametrize("given", [False, True], ids=["dynamic", "given"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TILE_SHAPES)
def test_emulated_cuda_nvfp4_16x16_partial_tiles(
    emu: EmulatedCudaModule, shape: tuple[int, ...], dtype: torch.dtype, given: bool
) -> None:
    # The warp-per-tile kernel: tiles cut by the last rows (N % 16) and by the last 8 columns
    # (K % 16 == 8), stacked experts; a NaN and an Inf in the last matrix (which poisons it
    # whole with a computed global scale, its own tiles alone with a given one).
    check_16x16_partial_tiles(emu, shape, dtype, given)


def check_16x16_partial_tiles(
    emu: EmulatedCudaModule, shape: tuple[int, ...], dtype: torch.dtype, given: bool
) -> None:
    stacked = len(shape) == 3
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).clamp(-6e4, 6e4)
    last = x[-1] if stacked else x
    last[1, 3] = float("nan")
    last[-1, -1] = float("-inf")
    x = x.to(dtype)
    kw: dict[str, object] = {"granularity": "16x16", "stacked": stacked}
    if given:
        kw["global_scale"] = torch.tensor(0.05)
    with on_emulator(emu):
        got = mq.quantize(x, "nvfp4", **kw, backend="native")  # type: ignore[arg-type]
    assert_same_quantized(got, mq.quantize(x, "nvfp4", **kw, backend="torch"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=[f"{f}-{g}-{r}" for f, g, r in CASES])
@pytest.mark.parametrize("dtype", MISALIGNED_DTYPES)
def test_emulated_cuda_scalar_kernels_on_misaligned_inputs(
    emu: EmulatedCudaModule, fmt: str, gran: str, rule: str | None, dtype: torch.dtype
) -> None:
    # Rows of whole chunks of 8, but an input not 16-byte aligned (a view one element into its
    # buffer): the launchers must take the scalar kernels, with the same bits.
    check_misaligned(emu, fmt, gran, rule, dtype)


def check_misaligned(
    emu: EmulatedCudaModule, fmt: str, gran: str, rule: str | None, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(2)
    rows, cols = 256, 160
    scale = 10.0 ** torch.randint(-3, 4, (1,), generator=g)
    buf = (torch.randn(rows * cols + 1, generator=g) * scale).to(dtype)
    x = buf[1:].view(rows, cols)
    assert x.data_ptr() % 16 != 0
    x[7, 9] = float("inf")
    kw = {"granularity": gran, "scale_rule": rule}
    with on_emulator(emu):
        got = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
    assert_same_quantized(got, mq.quantize(x, fmt, **kw, backend="torch"))  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_emulated_cuda_grid_stride_loops(emu: EmulatedCudaModule, fmt: str) -> None:
    # The tensor-level kernels cap their grids (the amax pass at 1024 blocks a matrix, the FP8
    # cast at 4096) and loop over the rest: matrices of 8.4M elements make every thread take
    # more than one chunk. Two experts, each with its own scale; the second holds an Inf.
    check_grid_stride(emu, fmt)


def check_grid_stride(emu: EmulatedCudaModule, fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8200, 1024, generator=g) * torch.tensor([1.0, 1e-3])[:, None, None]
    x = x.to(torch.bfloat16)
    x[1, 8199, 1000] = float("inf")
    x[0, 8199, 1023] = 300.0  # the first expert's amax at its last element
    kw = {"granularity": "tensor" if fmt == "fp8_e4m3" else "1x16", "stacked": True}
    with on_emulator(emu):
        got = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
    assert_same_quantized(got, mq.quantize(x, fmt, **kw, backend="native"))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_emulated_cuda_random_shapes(emu: EmulatedCudaModule, seed: int) -> None:
    # 100 random cases a seed: shapes around every group, tile and chunk edge, stacked experts,
    # inputs at every scale with NaN / Inf / zero runs, misaligned views, given NVFP4 global
    # scales and INT4 scale dtypes; the emulated kernels against the CPU kernels.
    check_random_shapes(emu, seed, 100)


def check_random_shapes(emu: EmulatedCudaModule, seed: int, n: int) -> None:
    rng = random.Random(seed)
    rows = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 130, 200, 257]
    cols = [1, 2, 7, 8, 9, 15, 16, 24, 31, 32, 40, 48, 56, 63, 64, 72, 96, 120, 127, 128, 136,
            160, 200, 256, 264, 384, 520, 700]  # fmt: skip
    done = 0
    while done < n:
        fmt, gran, rule = rng.choice(CASES)
        dtype = rng.choice(DTYPES)
        stacked = rng.random() < 0.3
        r, c = rng.choice(rows), rng.choice(cols)
        shape = (rng.randint(1, 4), r, c) if stacked else (r, c)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        x = torch.randn(shape, generator=g) * 10.0 ** rng.uniform(-6, 4)
        if rng.random() < 0.5:
            x = x * torch.logspace(rng.uniform(-4, 0), rng.uniform(0, 4), c)
        flat = x.view(-1)
        for _ in range(rng.randint(0, 3)):
            flat[rng.randrange(flat.numel())] = rng.choice([math.nan, math.inf, -math.inf, 0.0])
        if rng.random() < 0.2:
            at = rng.randrange(flat.numel())
            flat[at : at + rng.randint(1, 300)] = 0
        if dtype == torch.float16:
            x = torch.where(x.isfinite(), x.clamp(-65504, 65504), x)
        x = x.to(dtype)
        if rng.random() < 0.2:  # a view one element into its buffer: not 16-byte aligned
            buf = torch.empty(x.numel() + 1, dtype=dtype)
            buf[1:] = x.reshape(-1)
            x = buf[1:].view(shape)
        kw: dict[str, object] = {"granularity": gran, "scale_rule": rule, "stacked": stacked}
        if fmt == "nvfp4" and rng.random() < 0.3:
            kw["global_scale"] = torch.tensor(10.0 ** rng.uniform(-4, 2))
        if fmt.startswith("int4") and rng.random() < 0.5:
            kw["scale_dtype"] = rng.choice(DTYPES)
        try:
            cpu = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
        except ValueError:
            continue  # a shape this layout refuses (e.g. 16x16 of a 1-D stack)
        with on_emulator(emu):
            got = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
        assert_same_quantized(got, cpu)
        done += 1


def test_emulated_binding_checks_buffer_sizes(emu: EmulatedCudaModule) -> None:
    # The binding's size checks raise ValueError before any launch, with its own message.
    _native_calls_match_the_cuda_binding(emu)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_emulated_cuda_stacks_beyond_the_grid_limit(emu: EmulatedCudaModule, fmt: str) -> None:
    # Tensor-level scales of a stack take matrix b as blockIdx.y, which CUDA caps at 65535 (the
    # emulator refuses a larger grid as a GPU does): 70000 matrices go in two slices.
    check_beyond_grid_limit(emu, fmt)


def check_beyond_grid_limit(emu: EmulatedCudaModule, fmt: str) -> None:
    n = 70000
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, 1, 16, generator=g) * torch.logspace(-3, 3, n)[:, None, None]
    x[n - 1, 0, 3] = float("nan")
    x = x.to(torch.bfloat16)
    kw = {"granularity": "tensor" if fmt == "fp8_e4m3" else "1x16", "stacked": True}
    with on_emulator(emu):
        got = mq.quantize(x, fmt, **kw, backend="native")  # type: ignore[arg-type]
    assert_same_quantized(got, mq.quantize(x, fmt, **kw, backend="native"))  # type: ignore[arg-type]


def run_every_check(emu: EmulatedCudaModule) -> dict[str, int]:
    """Every check of this file's tests with every parameter (for the AddressSanitizer run);
    returns how many times each check ran."""
    runs: dict[str, int] = {}

    def run(check: Callable[..., None], *args: object) -> None:
        check(emu, *args)
        runs[check.__name__] = runs.get(check.__name__, 0) + 1

    for i in range(N_INPUTS):
        run(check_every_pattern, i)
    for shape in SHAPES:
        for dtype in DTYPES:
            for fmt, gran, rule in CASES:
                run(check_reference, fmt, gran, rule, dtype, shape)
            for gran in ("1x16", "16x16"):
                if gran != "16x16" or shape[-2] % 16 == 0:  # as the pytest case skips
                    run(check_given_scale, gran, dtype, shape)
    for shape in TILE_SHAPES:
        for dtype in DTYPES:
            for given in (False, True):
                run(check_16x16_partial_tiles, shape, dtype, given)
    for dtype in MISALIGNED_DTYPES:
        for fmt, gran, rule in CASES:
            run(check_misaligned, fmt, gran, rule, dtype)
    for fmt in ("fp8_e4m3", "nvfp4"):
        run(check_grid_stride, fmt)
        run(check_beyond_grid_limit, fmt)
    for seed in range(4):
        run(check_random_shapes, seed, 100)
    return runs


_ASAN_CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from _cuda_emu import EmulatedCudaModule
from test_cuda_emu import run_every_check
print(json.dumps(run_every_check(EmulatedCudaModule(Path(sys.argv[1])))))
"""


@pytest.mark.slow  # 45-140 s: every check above once more, instrumented
def test_emulated_cuda_under_address_sanitizer(tmp_path: Path) -> None:
    # Every check above again with the kernels built with -fsanitize=address: a read or write
    # outside the buffers torch allocated (which on a GPU corrupts memory silently or faults
    # later) stops the run with the kernel and line. ASan's runtime is preloaded into a child
    # Python; a stray one-byte write past an INT4 output is what it was seen to catch.
    require_native()
    runtime = asan_runtime()
    if runtime is None:
        pytest.skip("g++ has no libasan.so here")
    lib = build(tmp_path, asan=True)
    env = {**os.environ, "LD_PRELOAD": runtime, "ASAN_OPTIONS": "detect_leaks=0"}
    here = str(Path(__file__).resolve().parent)
    r = subprocess.run(
        [sys.executable, "-c", _ASAN_CHILD, str(lib), here],
        capture_output=True, text=True, timeout=1500, env=env, check=False,
    )  # fmt: skip
    assert "AddressSanitizer" not in r.stderr, r.stderr[-8000:]
    assert r.returncode == 0, r.stderr[-8000:]
    runs = json.loads(r.stdout.splitlines()[-1])
    checks = {name for name in globals() if name.startswith("check_")}
    assert set(runs) == checks, (runs, checks)
    assert runs["check_every_pattern"] == N_INPUTS
