"""Loaders and thin wrappers of the native extensions (C++ and CUDA in native/quant/).

miles_quant._ext holds the CPU kernels; miles_quant._ext_cuda the CUDA kernels (only in builds
with -Ccmake.define.MILES_QUANT_CUDA=ON). Importing this module never fails and never touches
CUDA: _ext_cuda is imported on the first CUDA tensor. Without _ext (not built, or disabled
with MILES_QUANT_DISABLE_NATIVE=1) `available()` is False, `error()` says why, and the API
uses the PyTorch reference. Each wrapper writes into output buffers the caller allocated (in
the layout miles_quant.quantize returns: any shape of the right size, contiguous, on the input's
device).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from miles_quant._spec import DTYPE_CODES, SCALE_RULE_CODES, Element

_ext: ModuleType | None
_error: str | None
try:
    if os.environ.get("MILES_QUANT_DISABLE_NATIVE", "") == "1":
        raise ImportError("disabled by MILES_QUANT_DISABLE_NATIVE=1")
    from miles_quant import _ext  # type: ignore[attr-defined,no-redef]

    _error = None
except ImportError as exc:  # not built, or built for another Python / platform
    _ext = None
    _error = f"{type(exc).__name__}: {exc}"

# CI (make test) sets MILES_REQUIRE_NATIVE=1: an extension that failed to build is an error there,
# not a quiet fallback that turns the native tests into skips. Disabling it on purpose still works.
if (
    _ext is None
    and os.environ.get("MILES_REQUIRE_NATIVE", "") == "1"
    and os.environ.get("MILES_QUANT_DISABLE_NATIVE", "") != "1"
):
    raise ImportError(
        f"MILES_REQUIRE_NATIVE=1 but miles-quant's native extension (the quantizer kernels) "
        f"did not load: {_error}. Rebuild it with a C++ compiler present "
        "(pip install --no-deps -e packages/miles-quant), "
        "or unset MILES_REQUIRE_NATIVE to run on the PyTorch fallback"
    )


def available() -> bool:
    """Whether the native CPU kernels can run in this process."""
    return _ext is not None


def error() -> str | None:
    """Why the native extension is unavailable (None when it is available)."""
    return _error


def isa() -> str | None:
    """The native kernels' instruction set ("avx512vbmi", "avx512", "avx2", "generic") or None."""
    return None if _ext is None else str(_ext.isa())


_cuda_ext: ModuleType | None = None
_cuda_error: str | None = None
_cuda_tried = False


def cuda_available() -> bool:
    """Whether the CUDA kernels were built (imports miles_quant._ext_cuda on first call)."""
    global _cuda_ext, _cuda_error, _cuda_tried
    if not _cuda_tried:
        _cuda_tried = True
        try:
            if os.environ.get("MILES_QUANT_DISABLE_NATIVE", "") == "1":
                raise ImportError("disabled by MILES_QUANT_DISABLE_NATIVE=1")
            from miles_quant import _ext_cuda  # type: ignore[attr-defined]

            _cuda_ext = _ext_cuda
        except ImportError as exc:
            _cuda_error = f"{type(exc).__name__}: {exc}"
    return _cuda_ext is not None


def cuda_error() -> str | None:
    """Why the CUDA kernels are unavailable (None when they are, or were not looked for)."""
    cuda_available()
    return _cuda_error


def _mod(x: torch.Tensor, threads: int | None) -> tuple[ModuleType, int]:
    """The extension for x's device and its last argument (CPU threads or the CUDA stream)."""
    if x.device.type == "cuda":
        if not cuda_available():
            raise RuntimeError(f"miles_quant CUDA kernels unavailable ({_cuda_error})")
        assert _cuda_ext is not None
        return _cuda_ext, int(torch.cuda.current_stream(x.device).cuda_stream)
    if _ext is None:
        raise RuntimeError(f"miles_quant native extension unavailable ({_error})")
    return _ext, _threads(threads)


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else int(threads)


# The kernels take each buffer as its address and size in bytes (t.data_ptr(), t.nbytes): a
# DLPack conversion costs about 2 us a tensor, more than the work of a small call. The callers
# (miles_quant.quantize) pass contiguous tensors on the kernels' device whose sizes match the
# layout; the binding checks the sizes again and raises ValueError on a mismatch.


def encode(x: torch.Tensor, el: Element, threads: int | None = None) -> torch.Tensor:
    """Raw element cast of a contiguous fp32 CPU tensor; uint8 codes of the same shape."""
    assert x.device.type == "cpu", "the raw element cast runs on CPU tensors"
    assert x.dtype == torch.float32, "encode takes float32"
    assert x.is_contiguous(), "encode takes a contiguous tensor"
    mod, last = _mod(x, threads)
    out = torch.empty(x.shape, dtype=torch.uint8)
    mod.encode(x.data_ptr(), x.nbytes, el.code, out.data_ptr(), out.nbytes, last)
    return out


def fp8(
    x: torch.Tensor,
    dims: tuple[int, int, int],
    el: Element,
    tile: tuple[int, int],
    per_matrix: bool,
    out: torch.Tensor,
    scales: torch.Tensor,
    threads: int | None = None,
) -> None:
    """x as [b, r, c] = dims; out: its codes (one byte each), scales: fp32, one per matrix
    (per_matrix) or per tile (b * ceil(r / tile[0]) * ceil(c / tile[1]), row-major)."""
    b, r, c = dims
    mod, last = _mod(x, threads)
    tr, tc = (max(r, 1), max(c, 1)) if per_matrix else tile
    mod.quantize_fp8(
        x.data_ptr(), x.nbytes, DTYPE_CODES[x.dtype], b, r, c, tr, tc, per_matrix, el.code,
        out.data_ptr(), out.nbytes, scales.data_ptr(), scales.nbytes, last,
    )  # fmt: skip


def mx(
    x: torch.Tensor,
    rows: int,
    el: Element,
    rule: str,
    out: torch.Tensor,
    scales: torch.Tensor,
    threads: int | None = None,
) -> None:
    """x as [rows, K]; out: [rows, K] codes (FP8 elements) or [rows, ceil(K / 2)] bytes
    (E2M1), scales: [rows, ceil(K / 32)] E8M0 bytes."""
    c = x.shape[-1]
    mod, last = _mod(x, threads)
    mod.quantize_mx(
        x.data_ptr(), x.nbytes, DTYPE_CODES[x.dtype], rows, c, el.code, SCALE_RULE_CODES[rule],
        out.data_ptr(), out.nbytes, scales.data_ptr(), scales.nbytes, last,
    )  # fmt: skip


def nvfp4(
    x: torch.Tensor,
    dims: tuple[int, int, int],
    tile16x16: bool,
    out: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    given: bool,
    threads: int | None = None,
) -> None:
    """x as [b, r, c] = dims; out: [b, r, ceil(c / 2)] bytes, scales: [b, r, ceil(c / 16)]
    E4M3 bytes, global_scale: fp32 [b], written by the kernel, or with `given` read by it (normal
    and positive, checked by the API: no amax pass, blocks with NaN / Inf poisoned alone)."""
    b, r, c = dims
    mod, last = _mod(x, threads)
    mod.quantize_nvfp4(
        x.data_ptr(), x.nbytes, DTYPE_CODES[x.dtype], b, r, c, tile16x16, out.data_ptr(),
        out.nbytes, scales.data_ptr(), scales.nbytes, global_scale.data_ptr(),
        global_scale.nbytes, last, given,
    )  # fmt: skip


def int4(
    x: torch.Tensor,
    rows: int,
    group: int,
    out: torch.Tensor,
    scales: torch.Tensor,
    threads: int | None = None,
) -> None:
    """x as [rows, K]; out: [rows, ceil(K / 2)] bytes, scales: [rows, ceil(K / group)] in
    scales.dtype (float32, bfloat16 or float16)."""
    c = x.shape[-1]
    mod, last = _mod(x, threads)
    mod.quantize_int4(
        x.data_ptr(), x.nbytes, DTYPE_CODES[x.dtype], rows, c, group, DTYPE_CODES[scales.dtype],
        out.data_ptr(), out.nbytes, scales.data_ptr(), scales.nbytes, last,
    )  # fmt: skip


def dequantize(
    data: torch.Tensor,
    code: int,
    dims: tuple[int, int, int],
    tile: tuple[int, int],
    scales: torch.Tensor,
    scale_kind: int,
    global_scale: torch.Tensor | None,
    out: torch.Tensor,
    threads: int | None = None,
) -> None:
    """CPU only. data: [b, r, c] codes as bytes (code 0 e4m3, 1 e5m2) or [b, r, ceil(c / 2)]
    packed nibbles (2 e2m1, 3 int4); scales: [b, ceil(r / tile[0]), ceil(c / tile[1])] of
    scale_kind (0 f32, 1 bf16, 2 f16, 3 e8m0, 4 e4m3), times global_scale[b] first when given
    (fp32 [b]); out: [b, r, c] float32 / bfloat16 / float16, value * scale rounded once."""
    b, r, c = dims
    mod, last = _mod(data, threads)
    g_ptr, g_nbytes = (
        (0, 0) if global_scale is None else (global_scale.data_ptr(), global_scale.nbytes)
    )
    mod.dequantize(
        data.data_ptr(), data.nbytes, code, b, r, c, tile[0], tile[1], scales.data_ptr(),
        scales.nbytes, scale_kind, g_ptr, g_nbytes, out.data_ptr(), out.nbytes,
        DTYPE_CODES[out.dtype], last,
    )  # fmt: skip
