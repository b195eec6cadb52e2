"""Disk-delta chunk kernels in native code: one compare-and-compact pass, and its inverse.

The PyTorch path of ``delta.codec`` finds changed elements with several kernels (compare,
``nonzero``, gathers, shuffles), each reading memory again, and hashes every tensor in another
pass. The C++ kernels in ``native/transfer/src/delta_scan.cpp`` (``miles_transfer._ext``;
AVX-512, AVX2 or portable code, chosen at run time) read the base and the new chunk once,
write the sparse patch's positions and values straight into scratch memory and feed the same
bytes to the xxh3-128 checksums (``StripeHash``); a second small pass lays the patch out as
byte planes. Apply copies, patches and hashes each chunk in one pass. The bytes and digests
are exactly those of the PyTorch path and ``xxhash`` (the file format does not change; tests
compare them bit for bit).

Scratch memory is one buffer per thread, reused across chunks: a fresh allocation per chunk
would pay first-touch page faults (about 0.7 GB/s here) on every call.
"""

from __future__ import annotations

import threading
from typing import Literal

import torch

from miles_transfer import _native
from miles_transfer._bytes import byte_view

__all__ = [
    "DeltaBackend",
    "StripeHash",
    "delta_isa",
    "delta_native_available",
    "native_apply_dense",
    "native_apply_fused",
    "native_apply_sparse",
    "native_encode",
    "resolve_backend",
]

DeltaBackend = Literal["auto", "native", "torch"]

_ext = _native.ext if _native.ext is not None and hasattr(_native.ext, "delta_scan") else None
_tls = threading.local()


def delta_native_available() -> bool:
    """Whether the native delta kernels can run in this process."""
    return _ext is not None


def delta_isa() -> str | None:
    """The native kernels' instruction set (``"avx512"``, ``"avx2"``, ``"generic"``) or None."""
    return None if _ext is None else str(_ext.delta_isa())


def resolve_backend(backend: DeltaBackend, *tensors: torch.Tensor) -> bool:
    """True to run a chunk natively: ``"auto"`` does when the kernels exist and the tensors
    are on the CPU.

    Raises:
        ValueError: an unknown backend, or ``"native"`` for a non-CPU tensor.
        RuntimeError: ``"native"`` without the extension.
    """
    if backend == "torch":
        return False
    if backend not in ("auto", "native"):
        raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")
    cpu = all(t.device.type == "cpu" for t in tensors)
    if backend == "auto":
        return _ext is not None and cpu
    if _ext is None:
        why = _native.error or "built without the delta kernels; reinstall miles-transfer"
        raise RuntimeError(
            f"miles_transfer native delta kernels unavailable ({why}); reinstall miles-transfer "
            "with a C++ compiler, or use backend='torch'"
        )
    if not cpu:
        raise ValueError("the native delta kernels work on CPU tensors only; use backend='torch'")
    return True


class StripeHash:
    """The xxh3-128 hex digest of one contiguous CPU tensor, computed by the native kernels.

    ``native_encode`` feeds it the tensor's chunks during its scan (no second read of the
    bytes); ``update`` feeds other pieces. The digest equals ``xxhash.xxh3_128_hexdigest`` of
    the tensor's bytes (tested). Only for tensors longer than 240 bytes, fed in order in pieces
    that start at multiples of 64 bytes: ``usable`` says whether this one may be used.

    Args:
        t: the tensor whose bytes are hashed (kept alive by this object).
    """

    @staticmethod
    def usable(nbytes: int, piece_bytes: int) -> bool:
        """Whether a tensor of ``nbytes`` hashed in pieces of ``piece_bytes`` can use this."""
        return _ext is not None and nbytes > 240 and piece_bytes % 64 == 0

    def __init__(self, t: torch.Tensor) -> None:
        assert _ext is not None
        assert t.device.type == "cpu"
        assert t.is_contiguous()
        self.t = t
        self.nbytes = t.numel() * t.element_size()
        self.state = torch.zeros(int(_ext.XXH3_STATE_BYTES) // 8, dtype=torch.int64)
        _ext.xxh3_long_init(self.state.data_ptr(), self.nbytes)

    @property
    def address(self) -> int:
        """The native state's address (for ``native_encode``)."""
        return int(self.state.data_ptr())

    def update(self, offset: int, nbytes: int) -> None:
        """Feed the tensor's bytes ``[offset, offset + nbytes)`` (offset a multiple of 64;
        pieces in order)."""
        assert _ext is not None
        _ext.xxh3_long_update(self.address, self.t.data_ptr() + offset, offset, nbytes)

    def hexdigest(self) -> str:
        """32 hex characters, once every byte was fed."""
        assert _ext is not None
        high, low = _ext.xxh3_long_digest(self.address, self.t.data_ptr() + self.nbytes)
        return f"{high:016x}{low:016x}"


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's scratch buffer, at least ``nbytes`` long (grown, never shrunk)."""
    buf: torch.Tensor | None = getattr(_tls, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        buf.fill_(0)  # fault the pages in once
        _tls.buf = buf
    return buf


def native_encode(
    base: torch.Tensor,
    new: torch.Tensor,
    xor: bool,
    sparse_max: int,
    hashes: tuple[StripeHash | None, StripeHash | None, int] = (None, None, 0),
) -> tuple[int, Literal["sparse", "dense"], memoryview]:
    """Compare two contiguous 1-D integer views of equal dtype and length.

    ``hashes``: ``(of new's tensor, of base's tensor, byte offset of this chunk in them)``;
    the scan feeds the chunk's bytes to the given digests.

    Returns ``(changed, layout, raw)``: the number of changed elements, and the chunk's raw
    bytes (sparse while ``changed <= sparse_max``, else dense; empty when nothing changed).
    ``raw`` aliases this thread's scratch buffer: use it before the next call on this thread.
    """
    assert _ext is not None
    assert base.is_contiguous()
    assert new.is_contiguous()
    assert base.dtype == new.dtype
    n, w = new.numel(), new.element_size()
    assert base.numel() == n
    assert 0 <= sparse_max <= n
    cap = sparse_max
    # [positions: 4 (cap + 16)][values: w cap + 64][raw: (4 + w) cap], or the dense raw (w n)
    # from offset 0 (the scan's slack: whole-register stores past the last entry).
    vals = 4 * (cap + 16)
    out = vals + w * cap + 64
    buf = _scratch(max(out + (4 + w) * cap, w * n))
    addr = buf.data_ptr()
    hn, hb, offset = hashes
    k = int(
        _ext.delta_scan(
            base.data_ptr(),
            new.data_ptr(),
            n,
            w,
            xor,
            addr,
            addr + vals,
            cap,
            0 if hn is None else hn.address,
            0 if hb is None else hb.address,
            offset,
        )
    )
    if k == 0:
        return 0, "sparse", memoryview(b"")
    if k <= cap:
        _ext.pack_sparse(addr, addr + vals, k, w, addr + out)
        return k, "sparse", _view(buf, out, (4 + w) * k)
    _ext.dense_encode(base.data_ptr(), new.data_ptr(), n, w, xor, addr)
    return k, "dense", _view(buf, 0, w * n)


def _view(buf: torch.Tensor, start: int, nbytes: int) -> memoryview:
    return byte_view(buf[start : start + nbytes])


def native_apply_sparse(target: torch.Tensor, raw: bytes, changed: int, xor: bool) -> None:
    """Patch a contiguous 1-D integer view in place from a sparse chunk's raw bytes.

    Raises:
        ValueError: the gaps are not strictly increasing or reach past the chunk (nothing is
            written then).
    """
    assert _ext is not None
    assert target.is_contiguous()
    n, w = target.numel(), target.element_size()
    status, last = _ext.sparse_apply(target.data_ptr(), n, w, bytes(raw), changed, xor)
    if status == 1:
        raise ValueError("malformed sparse chunk: positions are not strictly increasing")
    if status == 2:
        raise ValueError(f"malformed sparse chunk: position {last} >= chunk size {n}")


def native_apply_dense(target: torch.Tensor, raw: bytes, xor: bool) -> None:
    """Patch a contiguous 1-D integer view in place from a dense chunk's raw bytes."""
    assert _ext is not None
    assert target.is_contiguous()
    _ext.dense_apply(target.data_ptr(), target.numel(), target.element_size(), bytes(raw), xor)


_LAYOUTS = {None: 0, "sparse": 1, "dense": 2}


def native_apply_fused(
    target: torch.Tensor,
    source: torch.Tensor,
    layout: str | None,
    changed: int,
    raw: bytes,
    xor: bool,
    hashes: tuple[StripeHash | None, int],
) -> None:
    """One chunk of a result in one pass: ``target = source`` patched by the chunk (``layout``
    None: unchanged), its bytes fed to ``hashes[0]`` at byte offset ``hashes[1]``.

    ``target`` and ``source`` are contiguous 1-D integer views of one length (the same memory
    to patch in place). The caller checks ``raw``'s size against the layout first.

    Raises:
        ValueError: a sparse chunk's gaps are not strictly increasing or reach past the chunk
            (nothing is written then).
    """
    assert _ext is not None
    assert target.is_contiguous()
    assert source.is_contiguous()
    n, w = target.numel(), target.element_size()
    h, offset = hashes
    status, last = _ext.apply_fused(
        target.data_ptr(),
        source.data_ptr(),
        n,
        w,
        _LAYOUTS[layout],
        bytes(raw),
        changed,
        xor,
        0 if h is None else h.address,
        offset,
    )
    if status == 1:
        raise ValueError("malformed sparse chunk: positions are not strictly increasing")
    if status == 2:
        raise ValueError(f"malformed sparse chunk: position {last} >= chunk size {n}")
