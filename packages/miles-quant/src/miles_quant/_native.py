"""Loaders and thin wrappers of the native extensions (C++ and CUDA in native/quant/).

miles_quant._ext holds the CPU kernels; miles_quant._ext_cuda the CUDA kernels (only in builds
with -Ccmake.define.MILES_QUANT_CUDA=ON). Importing this module never fails and never touches
CUDA: _ext_cuda is imported on the first CUDA tensor. Without _ext (not built, or disabled
with MILES_QUANT_DISABLE_NATIVE=1) `available()` is False, `error()` says why, and the API
uses the PyTorch reference. Each wrapper allocates its outputs on the input's device in the
layout of the reference functions (miles_quant._reference), or writes into the caller's
buffers (`into`, from quantize's `out=`, checked by the API), and hands the buffers over.
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


def _raw(x: torch.Tensor) -> torch.Tensor:
    """The input buffer as a DLPack-friendly tensor of the same element size."""
    return x.view(torch.int16) if x.element_size() == 2 else x


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else int(threads)


def _buffers(
    x: torch.Tensor,
    given: tuple[torch.Tensor, ...] | None,
    layout: list[tuple[tuple[int, ...], torch.dtype]],
) -> list[torch.Tensor]:
    """The output buffers of a kernel: new ones, or views of the caller's (`given`, one per
    layout entry, any shape of the same number of elements; the API has checked them)."""
    if given is None:
        return [torch.empty(shape, dtype=dt, device=x.device) for shape, dt in layout]
    assert len(given) == len(layout)
    return [t.view(dt).view(shape) for t, (shape, dt) in zip(given, layout, strict=True)]


def encode(x: torch.Tensor, el: Element, threads: int | None = None) -> torch.Tensor:
    """Raw element cast of a contiguous fp32 CPU tensor; uint8 codes of the same shape."""
    assert x.device.type == "cpu", "the raw element cast runs on CPU tensors"
    mod, last = _mod(x, threads)
    out = torch.empty(x.shape, dtype=torch.uint8)
    mod.encode(x.reshape(-1), el.code, out.reshape(-1), last)
    return out


def fp8(
    x: torch.Tensor,
    el: Element,
    tile: tuple[int, int],
    per_matrix: bool,
    threads: int | None = None,
    into: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, r, c = x.shape
    mod, last = _mod(x, threads)
    tr, tc = (max(r, 1), max(c, 1)) if per_matrix else tile
    n_scales = (b,) if per_matrix else (b, -(-r // tr), -(-c // tc))
    out, scales = _buffers(x, into, [((b, r, c), torch.uint8), (n_scales, torch.float32)])
    mod.quantize_fp8(
        _raw(x), DTYPE_CODES[x.dtype], b, r, c, tr, tc, per_matrix, el.code, out, scales, last
    )
    return out, scales


def mx(
    x: torch.Tensor,
    el: Element,
    rule: str,
    threads: int | None = None,
    into: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, c = x.shape
    mod, last = _mod(x, threads)
    per_row = (c + 1) // 2 if el.torch_dtype is None else c
    out, scales = _buffers(
        x, into, [((rows, per_row), torch.uint8), ((rows, -(-c // 32)), torch.uint8)]
    )
    mod.quantize_mx(
        _raw(x), DTYPE_CODES[x.dtype], rows, c, el.code, SCALE_RULE_CODES[rule], out, scales, last
    )
    return out, scales


def nvfp4(
    x: torch.Tensor,
    tile16x16: bool,
    threads: int | None = None,
    into: tuple[torch.Tensor, ...] | None = None,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """global_scale: fp32 [b] on x's device, normal and positive (checked by the API): used
    instead of each matrix's amax (no amax pass; blocks with NaN / Inf are poisoned alone)."""
    b, r, c = x.shape
    mod, last = _mod(x, threads)
    out, scales, gscale = _buffers(
        x,
        into,
        [
            ((b, r, (c + 1) // 2), torch.uint8),
            ((b, r, -(-c // 16)), torch.uint8),
            ((b,), torch.float32),
        ],
    )
    given = global_scale is not None
    if global_scale is not None:
        gscale.copy_(global_scale)
    mod.quantize_nvfp4(
        _raw(x), DTYPE_CODES[x.dtype], b, r, c, tile16x16, out, scales, gscale, last, given
    )
    return out, scales, gscale


def int4(
    x: torch.Tensor,
    group: int,
    scale_dtype: torch.dtype,
    threads: int | None = None,
    into: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, c = x.shape
    mod, last = _mod(x, threads)
    out, scales = _buffers(
        x, into, [((rows, (c + 1) // 2), torch.uint8), ((rows, -(-c // group)), scale_dtype)]
    )
    mod.quantize_int4(
        _raw(x), DTYPE_CODES[x.dtype], rows, c, group, DTYPE_CODES[scale_dtype], out,
        _raw(scales), last,
    )  # fmt: skip
    return out, scales
