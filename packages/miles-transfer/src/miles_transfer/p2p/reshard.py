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
import math
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Literal

import torch

from miles_transfer import _native
from miles_transfer.p2p.plan import CopyOp, Strided

__all__ = [
    "Backend",
    "CopyProgram",
    "copy_ops",
    "pack",
    "packed_bytes",
    "reshard_native_available",
    "reshard_native_error",
    "unpack",
]

Backend = Literal["auto", "native", "torch"]

_ext: ModuleType | None = _native.ext
_error: str | None = _native.error

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


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


_BUF = ""  # the name standing for the packed buffer in a program


class CopyProgram:
    """Ops compiled once into a descriptor table; `run` only resolves base addresses.

    `mode` is "direct" (local tensor -> local tensor), "pack" (local tensors -> buffer) or
    "unpack" (buffer -> local tensors). Tensor names are checked against the expected shapes
    and element sizes once per call, not per op; every box lies inside its tensor by
    construction (asserted here), so no per-op bounds checks are needed at run time.
    """

    def __init__(self, ops: Sequence[CopyOp], mode: str) -> None:
        assert mode in ("direct", "pack", "unpack"), mode
        self.mode, self.nbytes = mode, packed_bytes(ops)
        src_names: dict[str, tuple[tuple[int, ...], int]] = {}
        dst_names: dict[str, tuple[tuple[int, ...], int]] = {}
        self.jobs: list[
            tuple[str, int, tuple[int, ...], tuple[int, ...], str, int, tuple[int, ...]]
        ]
        self.jobs = []
        at = 0
        for op in ops:
            st = _strided(op)
            if len(st.shape) > _MAX_DIMS:
                raise ValueError(
                    f"a copy box of {op.name!r} has {len(st.shape)} dims after merging; at most "
                    f"{_MAX_DIMS} are supported"
                )
            src = (op.src_name, st.src_offset, st.src_strides)
            dst = (op.dst_name, st.dst_offset, st.dst_strides)
            if mode == "pack":
                dst = (_BUF, at, _contiguous_strides(st.shape))
            elif mode == "unpack":
                src = (_BUF, at, _contiguous_strides(st.shape))
            if src[0]:
                _expect(src_names, op.src_name, op.src_shape, op.itemsize)
                assert _extent(st.src_offset, st.shape, st.src_strides) <= _nbytes(
                    op.src_shape, op.itemsize
                )
            if dst[0]:
                _expect(dst_names, op.dst_name, op.dst_shape, op.itemsize)
                assert _extent(st.dst_offset, st.shape, st.dst_strides) <= _nbytes(
                    op.dst_shape, op.itemsize
                )
            self.jobs.append((src[0], src[1], st.shape, src[2], dst[0], dst[1], dst[2]))
            at += st.nbytes
        self.src_names, self.dst_names = src_names, dst_names
        s_index = {n: i for i, n in enumerate(src_names)}
        d_index = {n: i for i, n in enumerate(dst_names)}
        width = 3 + 3 * _MAX_DIMS
        rows = []
        for _, so, shape, ss, _, do, ds in self.jobs:
            pad = (0,) * (_MAX_DIMS - len(shape))
            rows.append((so, do, len(shape), *shape, *pad, *ss, *pad, *ds, *pad))
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, width)
        self.src_idx = torch.tensor([s_index.get(j[0], 0) for j in self.jobs], dtype=torch.int64)
        self.dst_idx = torch.tensor([d_index.get(j[4], 0) for j in self.jobs], dtype=torch.int64)

    def run(
        self,
        srcs: Mapping[str, torch.Tensor] | torch.Tensor,
        dsts: Mapping[str, torch.Tensor] | torch.Tensor,
        backend: Backend,
        threads: int | None,
    ) -> int:
        src_t = _resolve_side(srcs, self.src_names, "source", self.nbytes, self.mode == "unpack")
        dst_t = _resolve_side(dsts, self.dst_names, "destination", self.nbytes, self.mode == "pack")
        if not self.jobs:
            return 0
        device = next(iter(src_t.values())).device
        for t in (*src_t.values(), *dst_t.values()):
            if t.device != device:
                raise ValueError(
                    f"all tensors of one copy must be on one device, got {device} and {t.device}"
                )
        if _resolve(backend, device) == "torch":
            views: dict[tuple[str, int, bool], torch.Tensor | None] = {}
            for sn, so, shape, ss, dn, do, ds in self.jobs:
                # Copy in the widest word (8/4/2/1 bytes) that every offset, stride and row
                # length allows: byte-wise element copies are several times slower.
                w = _word(so, do, shape[-1], *ss[:-1], *ds[:-1])
                sv = _wide(views, src_t, sn, w, False)
                dv = _wide(views, dst_t, dn, w, True)
                if sv is None or dv is None:
                    sv, dv, w = src_t[sn], dst_t[dn], 1
                wshape = (*shape[:-1], shape[-1] // w)
                wss = (*(x // w for x in ss[:-1]), 1)
                wds = (*(x // w for x in ds[:-1]), 1)
                dv.as_strided(wshape, wds, do // w).copy_(sv.as_strided(wshape, wss, so // w))
            return self.nbytes
        assert _ext is not None
        sp = torch.tensor([t.data_ptr() for t in src_t.values()], dtype=torch.int64)
        dp = torch.tensor([t.data_ptr() for t in dst_t.values()], dtype=torch.int64)
        desc = self.table.clone()
        desc[:, 0] += sp[self.src_idx]
        desc[:, 1] += dp[self.dst_idx]
        _ext.copy(desc, torch.get_num_threads() if threads is None else int(threads))
        return self.nbytes


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _word(*values: int) -> int:
    for w in (8, 4, 2):
        if all(v % w == 0 for v in values):
            return w
    return 1


def _wide(
    cache: dict[tuple[str, int, bool], torch.Tensor | None],
    tensors: Mapping[str, torch.Tensor],
    name: str,
    w: int,
    dst: bool,
) -> torch.Tensor | None:
    """tensors[name] (a byte view) as w-byte words, or None where size or address forbid it."""
    key = (name, w, dst)
    if key not in cache:
        t = tensors[name]
        ok = w == 1 or (t.numel() % w == 0 and t.data_ptr() % w == 0)
        cache[key] = (t if w == 1 else t.view(_WORDS[w])) if ok else None
    return cache[key]


def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    return itemsize * math.prod(shape)


def _extent(off: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    if any(n == 0 for n in shape):
        return 0
    return off + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1


def _expect(
    names: dict[str, tuple[tuple[int, ...], int]], name: str, shape: tuple[int, ...], size: int
) -> None:
    got = names.setdefault(name, (shape, size))
    assert got == (shape, size), f"the plan disagrees with itself about {name!r}"


def _resolve_side(
    given: Mapping[str, torch.Tensor] | torch.Tensor,
    names: Mapping[str, tuple[tuple[int, ...], int]],
    side: str,
    nbytes: int,
    is_buffer: bool,
) -> dict[str, torch.Tensor]:
    """Byte views of the named tensors (or of the buffer), checked against the plan."""
    if is_buffer:
        assert isinstance(given, torch.Tensor)
        what = "unpack: buf" if side == "source" else "pack: out"
        if given.dtype != torch.uint8 or given.dim() != 1 or not given.is_contiguous():
            raise ValueError(
                f"{what} must be a contiguous 1-D uint8 tensor, got "
                f"{given.dtype}{list(given.shape)}"
            )
        if given.numel() < nbytes:
            raise ValueError(
                f"{what} holds {given.numel()} bytes but the ops need {nbytes}; allocate "
                "packed_bytes(ops)"
            )
        return {_BUF: given}
    assert not isinstance(given, torch.Tensor)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, itemsize) in names.items():
        t = given.get(name)
        if t is None:
            raise ValueError(
                f"no {side} tensor named {name!r}; pass every local tensor of the rank's layout"
            )
        if tuple(t.shape) != shape or t.element_size() != itemsize:
            raise ValueError(
                f"{side} tensor {name!r} is {t.dtype}{list(t.shape)}, but the plan expects shape "
                f"{list(shape)} with {itemsize}-byte elements; allocate it from the layout"
            )
        out[name] = _bytes_of(t, name)
    return out


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
    CopyProgram(ops, "direct").run(srcs, dsts, backend, threads)


def pack(
    ops: Sequence[CopyOp],
    srcs: Mapping[str, torch.Tensor],
    out: torch.Tensor,
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> int:
    """Gather the ops' boxes from `srcs` into `out` back to back; returns the bytes written."""
    return CopyProgram(ops, "pack").run(srcs, out, backend, threads)


def unpack(
    ops: Sequence[CopyOp],
    buf: torch.Tensor,
    dsts: Mapping[str, torch.Tensor],
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> int:
    """Scatter a buffer written by `pack(ops, ...)` into `dsts`; returns the bytes read."""
    return CopyProgram(ops, "unpack").run(buf, dsts, backend, threads)
