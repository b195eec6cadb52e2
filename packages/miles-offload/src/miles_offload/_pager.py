"""Bulk file I/O for optimizer buckets: aligned buffers, O_DIRECT files, CRC-32C.

`Pager` moves whole buffers between memory and files. Backends, in order of preference:

- ``"io_uring"``: the native pager (liburing): each transfer is cut into ``block_size``
  requests kept ``queue_depth`` deep, submitted in batches, on registered (fixed) buffers.
- ``"threads"``: the native pread/pwrite thread pool (``queue_depth`` threads, capped at 64).
  Chosen with a one-time warning when ``io_uring_queue_init`` fails (old kernels, seccomp
  filters in containers), or on request.
- ``"python"``: ``os.preadv``/``os.pwritev`` on a Python thread pool, when the extension is
  missing (one-time warning).

``MILES_OFFLOAD_PAGER=io_uring|threads|python`` overrides ``backend="auto"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from miles_offload import _native

__all__ = [
    "ALIGN",
    "BACKENDS",
    "HUGE_PAGE",
    "Pager",
    "aligned_empty",
    "crc32c",
    "open_direct",
    "preallocate",
]

ALIGN = 4096  # O_DIRECT alignment of addresses, offsets and lengths (the page size)
HUGE_PAGE = 2 << 20  # transparent huge page size (x86-64, and arm64 with 4 KiB pages)
BACKENDS = ("auto", "io_uring", "threads", "python")


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A pre-faulted uint8 CPU tensor of ``nbytes`` whose address is a multiple of ``ALIGN``.

    Pre-faulting (zero fill) makes the first-touch page faults happen here, once, instead of
    inside the first transfer or update (first touch runs below 1 GB/s on small VMs). Buffers
    of ``HUGE_PAGE`` bytes or more are asked to use transparent huge pages: they are then
    physically contiguous in 2 MiB pieces, so a transfer needs one DMA segment per piece
    instead of one per 4 KiB page (on a VM here, O_DIRECT writes from ordinary pages ran at
    2.2-3.3 GB/s depending on how fragmented the memory was, and at 3.1-3.5 GB/s from huge
    pages; see docs/benchmarks.md). Where huge pages are unavailable the buffer is the same,
    on ordinary pages. With ``pin`` (only meaningful with CUDA) the memory is page-locked for
    fast device copies instead.
    """
    if nbytes % ALIGN:
        raise ValueError(f"nbytes must be a multiple of {ALIGN}, got {nbytes}")
    if pin:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
        align = ALIGN
    elif nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # Map one huge page more than needed so that the buffer can start on a 2 MiB boundary.
        # The tensor keeps the mapping alive; it is unmapped when the last view is freed.
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # kernels built without THP refuse the advice
            region.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(region, dtype=torch.uint8)
        align = HUGE_PAGE
    else:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        align = ALIGN
    skip = (-raw.data_ptr()) % align
    out = raw[skip : skip + nbytes]
    out.zero_()
    return out


def open_direct(path: str | os.PathLike[str], *, create: bool) -> tuple[int, bool]:
    """Open ``path`` read-write with O_DIRECT; return (fd, direct).

    Filesystems without O_DIRECT (tmpfs) refuse it with EINVAL: the file is then opened
    buffered and ``direct`` is False (same bytes, through the page cache).
    """
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    return os.open(path, flags, 0o644), False


# fallocate(2) through libc (os has only posix_fallocate, whose glibc emulation for filesystems
# without fallocate writes single bytes, which O_DIRECT files refuse). None: not available.
_FALLOCATE: Any = None
_FALLOCATE_LOOKED_UP = False
# errnos meaning "this filesystem or kernel cannot preallocate": a sparse file is used instead.
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV}


def _fallocate() -> Any:
    global _FALLOCATE, _FALLOCATE_LOOKED_UP
    if not _FALLOCATE_LOOKED_UP:
        _FALLOCATE_LOOKED_UP = True
        try:
            fn = ctypes.CDLL(None, use_errno=True).fallocate
        except (AttributeError, OSError):  # not Linux
            fn = None
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
        _FALLOCATE = fn
    return _FALLOCATE


def preallocate(fd: int, nbytes: int) -> bool:
    """Make the file ``fd`` exactly ``nbytes`` long with its blocks allocated up front.

    ``fallocate(fd, 0, 0, nbytes)``, as fio lays out a new file before writing it: a full disk
    fails here, before any byte of the transfer, and the extents are allocated in one call
    instead of under each O_DIRECT write. Existing data is kept (a longer file is truncated
    first). Where the filesystem cannot preallocate, the file is extended sparsely instead.

    Returns:
        True if the blocks were preallocated, False if the file was extended sparsely.

    Raises:
        OSError: the space cannot be allocated (ENOSPC, EFBIG, EDQUOT, EIO, ...).
    """
    if os.fstat(fd).st_size > nbytes:
        os.ftruncate(fd, nbytes)
    fn = _fallocate()
    while fn is not None and nbytes > 0:
        if fn(fd, 0, 0, nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err in _NO_FALLOCATE:
            break
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, nbytes)
    return False


_CRC_TABLE: list[int] | None = None


def _crc32c_python(data: bytes | memoryview, crc: int) -> int:
    global _CRC_TABLE
    if _CRC_TABLE is None:
        table = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            table.append(c)
        _CRC_TABLE = table
    t = _CRC_TABLE
    c = crc ^ 0xFFFFFFFF
    for b in bytes(data):
        c = (c >> 8) ^ t[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def _view(buf: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no numpy needed)."""
    n = buf.numel() * buf.element_size()
    return memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")


def crc32c(buf: torch.Tensor, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of a contiguous CPU tensor's bytes, continuing from ``crc``."""
    assert buf.is_contiguous()
    assert buf.device.type == "cpu"
    n = buf.numel() * buf.element_size()
    if _native._ext is not None:
        return int(_native._ext.crc32c(buf.data_ptr(), n, crc))
    _native.warn_once(
        "crc",
        f"miles_offload: native extension unavailable ({_native.error()}); CRC-32C runs in "
        "pure Python (about 10 MB/s). Reinstall miles-offload with a C++ compiler.",
    )
    return _crc32c_python(_view(buf), crc)


class Pager:
    """Blocking whole-buffer reads and writes at file offsets.

    Args:
        queue_depth: requests in flight per transfer (1..4096).
        block_size: bytes per request, a multiple of 4096.
        backend: "auto" (io_uring, else the thread pool with a warning), "io_uring" (fail if
            unavailable), "threads" or "python".

    Raises:
        ValueError: a bad queue depth, block size or backend name.
        RuntimeError: ``backend="io_uring"`` where io_uring cannot run.
    """

    def __init__(
        self, *, queue_depth: int = 32, block_size: int = 1 << 20, backend: str = "auto"
    ) -> None:
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in [1, 4096], got {queue_depth}")
        if block_size <= 0 or block_size % ALIGN or block_size > 1 << 30:
            raise ValueError(
                f"block_size must be a positive multiple of {ALIGN} bytes (at most 1 GiB), "
                f"got {block_size}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            backend = os.environ.get("MILES_OFFLOAD_PAGER", "") or "auto"
            if backend not in BACKENDS:
                raise ValueError(
                    f"MILES_OFFLOAD_PAGER must be one of {BACKENDS[1:]}, got {backend!r}"
                )
        self.queue_depth = queue_depth
        self.block_size = block_size
        self._impl: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._stats = {
            "bytes_read": 0,
            "bytes_written": 0,
            "requests": 0,
            "fixed_requests": 0,
            "submit_calls": 0,
        }
        if backend != "python" and _native._ext is not None:
            self._impl = _native._ext.Pager(queue_depth, block_size, backend == "threads")
            got = str(self._impl.backend)
            if backend == "io_uring" and got != "io_uring":
                raise RuntimeError(
                    f"miles_offload: io_uring is unavailable ({self._impl.fallback_reason}); "
                    'use backend="threads" or "auto"'
                )
            if backend == "auto" and got != "io_uring":
                _native.warn_once(
                    "uring",
                    f"miles_offload: io_uring unavailable ({self._impl.fallback_reason}); the "
                    "pager uses its pread/pwrite thread pool (slower at high queue depth)",
                )
            self.backend = got
        else:
            if backend in ("io_uring", "threads"):
                raise RuntimeError(
                    f"miles_offload: the native pager is unavailable ({_native.error()}); "
                    'use backend="python" or "auto"'
                )
            if backend == "auto":
                _native.warn_once(
                    "pager",
                    f"miles_offload: native extension unavailable ({_native.error()}); the "
                    "pager runs os.preadv/os.pwritev on Python threads",
                )
            self.backend = "python"
            self._pool = ThreadPoolExecutor(min(queue_depth, 16), "miles-offload-io")

    @property
    def fallback_reason(self) -> str:
        """Why io_uring is not in use ("" when it is)."""
        if self._impl is None:
            return f"native extension unavailable ({_native.error()})"
        return str(self._impl.fallback_reason)

    def register(self, buffers: list[torch.Tensor]) -> bool:
        """Register buffers for fixed-buffer io_uring I/O; False if the kernel refused."""
        if self._impl is None:
            return True
        rc = self._impl.register_buffers([(b.data_ptr(), b.numel()) for b in buffers])
        return rc == 0

    def _check(self, offset: int, buf: torch.Tensor) -> int:
        n = buf.numel() * buf.element_size()
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("pager buffers must be contiguous CPU tensors")
        if offset % ALIGN or n % ALIGN or buf.data_ptr() % ALIGN:
            raise ValueError(
                f"O_DIRECT needs offset, length and address aligned to {ALIGN} bytes "
                f"(got offset {offset}, length {n}, address % {ALIGN} = "
                f"{buf.data_ptr() % ALIGN}); allocate buffers with aligned_empty()"
            )
        return n

    def read(self, fd: int, offset: int, buf: torch.Tensor, *, crc_from: int = -1) -> int:
        """Fill ``buf`` from ``fd`` at ``offset``; OSError on I/O errors or a short file.

        With ``crc_from >= 0`` returns the CRC-32C of ``buf[crc_from:]`` (io_uring computes it
        over the blocks that have arrived while later ones are in flight); else 0.
        """
        n = self._check(offset, buf)
        if self._impl is not None:
            rc, crc = self._impl.read(fd, offset, buf.data_ptr(), n, crc_from)
            if rc:
                raise OSError(rc, f"miles_offload pager read of {n} bytes: {os.strerror(rc)}")
            return int(crc)
        self._python_xfer(fd, offset, buf, n, write=False)
        return crc32c(buf[crc_from:]) if crc_from >= 0 else 0

    def write(self, fd: int, offset: int, buf: torch.Tensor, *, crc_from: int = -1) -> int:
        """Write ``buf`` to ``fd`` at ``offset``; OSError on I/O errors.

        With ``crc_from >= 0`` returns the CRC-32C of ``buf[crc_from:]`` (io_uring computes each
        block's share just before submitting it, while earlier blocks are in flight); else 0.
        """
        n = self._check(offset, buf)
        if self._impl is not None:
            rc, crc = self._impl.write(fd, offset, buf.data_ptr(), n, crc_from)
            if rc:
                raise OSError(rc, f"miles_offload pager write of {n} bytes: {os.strerror(rc)}")
            return int(crc)
        crc = crc32c(buf[crc_from:]) if crc_from >= 0 else 0
        self._python_xfer(fd, offset, buf, n, write=True)
        return crc

    def _python_xfer(self, fd: int, offset: int, buf: torch.Tensor, n: int, write: bool) -> None:
        assert self._pool is not None
        view = _view(buf)

        def chunk(pos: int) -> None:
            end = min(n, pos + self.block_size)
            while pos < end:
                part = view[pos:end]
                done = (
                    os.pwritev(fd, [part], offset + pos)
                    if write
                    else os.preadv(fd, [part], offset + pos)
                )
                if done == 0:
                    raise OSError(errno.ENODATA, "miles_offload pager: unexpected end of file")
                pos += done

        futures = [self._pool.submit(chunk, p) for p in range(0, n, self.block_size)]
        for f in futures:
            f.result()
        self._stats["bytes_written" if write else "bytes_read"] += n
        self._stats["requests"] += len(futures)

    def stats(self) -> dict[str, int]:
        """Bytes read and written, requests issued (``fixed_requests`` of them on registered
        buffers, io_uring only) and io_uring submit calls so far."""
        if self._impl is not None:
            return {k: int(v) for k, v in self._impl.stats().items()}
        return dict(self._stats)

    def close(self) -> None:
        """Stop the worker threads (the native pager stops when garbage-collected)."""
        if self._pool is not None:
            self._pool.shutdown()
        self._impl = None
