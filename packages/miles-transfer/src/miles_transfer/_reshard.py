"""Re-sharding copies: a plan's boxes moved between local tensors, native C++ or PyTorch.

Three operations, all byte-exact (bytes are copied, never values converted):

- `copy_ops(ops, srcs, dsts)`: each op's box from a source local tensor straight into a
  destination local tensor (both ends in one process).
- `pack(ops, srcs, out)`: the ops' boxes, one after the other in op order and each contiguous
  (row-major), into the uint8 buffer `out` (a bucket to send).
- `unpack(ops, buf, dsts)`: the inverse, from a received bucket into the destination tensors.

`backend="native"` runs the C++ kernel (miles_transfer._ext: strided memcpy over rows, spread
over `threads` threads, without the GIL); `"torch"` the reference (`as_strided(...).copy_` on
byte views); `"auto"` picks native for CPU tensors when the extension is built and torch
otherwise (CUDA tensors, or no compiler at install time: a warning is issued once).
`MILES_TRANSFER_DISABLE_NATIVE=1` turns the extension off.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Literal

import torch

from miles_transfer._plan import CopyOp, Strided

__all__ = [
    "Backend",
    "copy_ops",
    "reshard_native_available",
    "reshard_native_error",
    "pack",
    "packed_bytes",
    "unpack",
]

Backend = Literal["auto", "native", "torch"]

_ext: ModuleType | None
_error: str | None
try:
    if os.environ.get("MILES_TRANSFER_DISABLE_NATIVE", "") == "1":
        raise ImportError("disabled by MILES_TRANSFER_DISABLE_NATIVE=1")
    from miles_transfer import _ext  # type: ignore[attr-defined,no-redef]

    _error = None
except ImportError as exc:  # not built (no compiler at install), or another Python / platform
    _ext = None
    _error = f"{type(exc).__name__}: {exc}"

_MAX_DIMS = 6 if _ext is None else int(_ext.MAX_DIMS)
_warned = False


def reshard_native_available() -> bool:
    """Whether the C++ re-sharding kernel can run in this process."""
    return _ext is not None


def reshard_native_error() -> str | None:
    """Why the native extension is unavailable (None when it is available)."""
    return _error


@functools.lru_cache(maxsize=1 << 16)
def _strided(op: CopyOp) -> Strided:
    return op.strided()


def packed_bytes(ops: Sequence[CopyOp]) -> int:
    """Size of the buffer `pack(ops, ...)` fills."""
    return sum(o.nbytes for o in ops)


def _bytes_of(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(
            f"{what} must be contiguous (a row-major local tensor), got strides {t.stride()}"
        )
    return t.reshape(-1).view(torch.uint8)


def _check(
    t: torch.Tensor | None, name: str, shape: tuple[int, ...], itemsize: int, side: str
) -> torch.Tensor:
    if t is None:
        raise ValueError(
            f"no {side} tensor named {name!r}; pass every local tensor of the rank's layout"
        )
    if tuple(t.shape) != shape or t.element_size() != itemsize:
        raise ValueError(
            f"{side} tensor {name!r} is {t.dtype}{list(t.shape)}, but the plan expects shape "
            f"{list(shape)} with {itemsize}-byte elements; allocate it from the layout"
        )
    return t


def _resolve(backend: Backend, device: torch.device) -> str:
    global _warned
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")
    if backend == "torch" or device.type != "cpu":
        if backend == "native":
            raise ValueError(
                f"the native kernel copies CPU tensors only, got {device}; use backend='torch'"
            )
        return "torch"
    if _ext is None:
        if backend == "native":
            raise RuntimeError(
                f"miles_transfer native extension unavailable ({_error}); reinstall "
                "miles-transfer with a C++ compiler"
            )
        if not _warned:
            _warned = True
            warnings.warn(
                f"miles_transfer: native re-sharding extension unavailable ({_error}); using the "
                "PyTorch reference (same bytes, slower). Reinstall with a C++ compiler to build "
                "it.",
                RuntimeWarning,
                stacklevel=3,
            )
        return "torch"
    return "native"


# A job: (source bytes, source offset, shape, source strides, dest bytes, dest offset, strides).
_Job = tuple[
    torch.Tensor, int, tuple[int, ...], tuple[int, ...], torch.Tensor, int, tuple[int, ...]
]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _in_bounds(
    buf: torch.Tensor, off: int, shape: tuple[int, ...], strides: tuple[int, ...]
) -> bool:
    if any(n == 0 for n in shape):
        return True
    last = off + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    return off >= 0 and last < buf.numel()


def _run(jobs: list[_Job], backend: Backend, threads: int | None) -> None:
    if not jobs:
        return
    device = jobs[0][0].device
    for j in jobs:
        if j[0].device != device or j[4].device != device:
            raise ValueError(
                "all tensors of one copy must be on one device, got "
                f"{j[0].device} and {j[4].device}"
            )
        assert _in_bounds(j[0], j[1], j[2], j[3]), "source box out of bounds"
        assert _in_bounds(j[4], j[5], j[2], j[6]), "destination box out of bounds"
    if _resolve(backend, device) == "torch":
        for src, so, shape, ss, dst, do, ds in jobs:
            dst.as_strided(shape, ds, do).copy_(src.as_strided(shape, ss, so))
        return
    assert _ext is not None
    width = 3 + 3 * _MAX_DIMS
    desc = torch.zeros((len(jobs), width), dtype=torch.int64)
    rows = []
    for src, so, shape, ss, dst, do, ds in jobs:
        if len(shape) > _MAX_DIMS:
            raise ValueError(
                f"a copy box has {len(shape)} dims after merging; at most {_MAX_DIMS} are supported"
            )
        pad = (0,) * (_MAX_DIMS - len(shape))
        rows.append((src.data_ptr() + so, dst.data_ptr() + do, len(shape), *shape, *pad,
                     *ss, *pad, *ds, *pad))  # fmt: skip
    desc.copy_(torch.tensor(rows, dtype=torch.int64))
    _ext.copy(desc, torch.get_num_threads() if threads is None else int(threads))


def copy_ops(
    ops: Sequence[CopyOp],
    srcs: Mapping[str, torch.Tensor],
    dsts: Mapping[str, torch.Tensor],
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> None:
    """Copy each op's box from `srcs[op.src_name]` into `dsts[op.dst_name]` (in place).

    Args:
        ops: copies of one source rank into one destination rank (e.g. `plan.ops_between`).
        srcs, dsts: the ranks' local tensors (contiguous, shapes as in the layouts).
        backend: "auto" | "native" | "torch" (module docstring).
        threads: native threads (default torch.get_num_threads()).

    Raises:
        ValueError: a local tensor is missing, has the wrong shape or element size, or is not
            contiguous.
    """
    jobs: list[_Job] = []
    for op in ops:
        s = _check(srcs.get(op.src_name), op.src_name, op.src_shape, op.itemsize, "source")
        d = _check(dsts.get(op.dst_name), op.dst_name, op.dst_shape, op.itemsize, "destination")
        st = _strided(op)
        jobs.append((_bytes_of(s, op.src_name), st.src_offset, st.shape, st.src_strides,
                     _bytes_of(d, op.dst_name), st.dst_offset, st.dst_strides))  # fmt: skip
    _run(jobs, backend, threads)


def _buffer(buf: torch.Tensor, need: int, what: str) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D uint8 tensor, got {buf.dtype}{list(buf.shape)}"
        )
    if buf.numel() < need:
        raise ValueError(
            f"{what} holds {buf.numel()} bytes but the ops need {need}; allocate packed_bytes(ops)"
        )
    return buf


def pack(
    ops: Sequence[CopyOp],
    srcs: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> int:
    """Gather the ops' boxes from `srcs` into `out` back to back; returns the bytes written."""
    out = _buffer(out, packed_bytes(ops), "pack: out")
    jobs: list[_Job] = []
    at = 0
    for op in ops:
        s = _check(srcs.get(op.src_name), op.src_name, op.src_shape, op.itemsize, "source")
        st = _strided(op)
        jobs.append((_bytes_of(s, op.src_name), st.src_offset, st.shape, st.src_strides,
                     out, at, _contiguous_strides(st.shape)))  # fmt: skip
        at += st.nbytes
    _run(jobs, backend, threads)
    return at


def unpack(
    ops: Sequence[CopyOp],
    buf: torch.Tensor,
    dsts: Mapping[str, torch.Tensor],
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> int:
    """Scatter a buffer written by `pack(ops, ...)` into `dsts`; returns the bytes read."""
    buf = _buffer(buf, packed_bytes(ops), "unpack: buf")
    jobs: list[_Job] = []
    at = 0
    for op in ops:
        d = _check(dsts.get(op.dst_name), op.dst_name, op.dst_shape, op.itemsize, "destination")
        st = _strided(op)
        jobs.append((buf, at, st.shape, _contiguous_strides(st.shape),
                     _bytes_of(d, op.dst_name), st.dst_offset, st.dst_strides))  # fmt: skip
        at += st.nbytes
    _run(jobs, backend, threads)
    return at
