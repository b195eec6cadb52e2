"""Where bucket buffers live: all in RAM (`CpuStore`) or in files streamed through a small pool
of buffers (`NvmeStore`).

`visit(order, fn)` hands every listed bucket's buffer to ``fn`` (in the caller's thread) and
keeps what ``fn`` changed. `NvmeStore` pipelines it over a pool of three pre-faulted, aligned,
io_uring-registered buffers: while ``fn`` updates bucket i, a reader thread loads bucket i+1 and
a writer thread stores bucket i-1, so at most three buckets are resident at any time.

Between passes the pool buffers keep the last buckets written (header and payload, exactly the
bytes of the committed files). A pass that may run in any order (``reorder=True``, as
`AdamW.step` does) starts with those buckets and does not read them again: each step reads
``POOL_BUFFERS`` buckets fewer than it writes, and its first update starts at once instead of
after a read. The next pass then ends with the other buckets, so the saving repeats every step.

Crash safety: each bucket has two files (slots 0 and 1). A pass that writes buckets puts every
bucket into the slot the committed manifest does not name, syncs each file after writing it,
then atomically replaces ``manifest.json`` (write, fsync, rename, fsync the directory). A crash
before the rename leaves the previous manifest and every file it names untouched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, TypeGuard

import torch

from miles_offload._format import CorruptStateError, decode_header, encode_header
from miles_offload._layout import Bucket
from miles_offload._pager import Pager, aligned_empty, open_direct, preallocate

__all__ = ["LOCK_FILE", "MANIFEST", "POOL_BUFFERS", "CpuStore", "NvmeStore"]

MANIFEST = "manifest.json"
LOCK_FILE = ".lock"  # flock-ed by the one optimizer using the directory
POOL_BUFFERS = 3  # resident bucket buffers of NvmeStore: read i+1, update i, write i-1
_MANIFEST_FORMAT = "miles-offload-manifest"

VisitFn = Callable[[Bucket, torch.Tensor], None]


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_manifest(manifest: Any, where: Path) -> None:
    """Check the shape of a manifest read from ``where`` (version 1)::

        {"format": "miles-offload-manifest", "version": 1, "layout": str,
         "generation": int >= 0, "buckets": [{"slot": 0 | 1, "generation": int}, ...]}

    where no bucket's generation exceeds the manifest's.

    Raises:
        CorruptStateError: the first field that does not fit, named with the file.
    """

    def bad(field: str, want: str, got: Any) -> CorruptStateError:
        return CorruptStateError(
            f"{where}: field {field} must be {want}, got {json.dumps(got)[:80]}"
        )

    if not isinstance(manifest, dict):
        raise CorruptStateError(
            f"{where}: not a miles-offload manifest (a JSON {type(manifest).__name__}, not an "
            "object)"
        )
    if manifest.get("format") != _MANIFEST_FORMAT or manifest.get("version") != 1:
        raise CorruptStateError(f"{where}: not a miles-offload manifest (version 1)")
    if not isinstance(manifest.get("layout"), str):
        raise bad("layout", "a string", manifest.get("layout"))
    top = manifest.get("generation")
    if not _int(top) or top < 0:
        raise bad("generation", "an integer >= 0", top)
    buckets = manifest.get("buckets")
    if not isinstance(buckets, list):
        raise bad("buckets", "a list", buckets)
    for i, entry in enumerate(buckets):
        if not isinstance(entry, dict):
            raise bad(f"buckets[{i}]", 'an object {"slot", "generation"}', entry)
        if entry.get("slot") not in (0, 1) or isinstance(entry.get("slot"), bool):
            raise bad(f"buckets[{i}].slot", "0 or 1", entry.get("slot"))
        gen = entry.get("generation")
        if not _int(gen) or not 0 <= gen <= top:
            raise bad(f"buckets[{i}].generation", f"an integer in [0, {top}]", gen)


# The lock files of this process's optimizers. A forked child (a DataLoader worker) would
# otherwise share them and keep a directory locked after the parent's close(): children close
# their copies (the parent's lock stays held).
_LOCKS: weakref.WeakSet[IO[str]] = weakref.WeakSet()


def _close_locks_in_child() -> None:
    for f in list(_LOCKS):
        with contextlib.suppress(OSError):
            f.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_locks_in_child)

# How long a lock that names this very process, while this process holds no open lock on the
# directory, is waited for: that is a child forked a moment ago that has not yet run its at-fork
# hook (it shares the parent's lock until then).
_INHERITED_LOCK_WAIT_S = 2.0


def _inherited(path: Path, holder: str) -> bool:
    """The lock on `path` names this process, yet none of its open locks is on `path`: only a
    forked child can hold it (a copy it has not closed yet)."""
    if holder != str(os.getpid()):
        return False
    lock = os.path.abspath(path / LOCK_FILE)
    return not any(not g.closed and os.path.abspath(g.name) == lock for g in list(_LOCKS))


def _lock_dir(path: Path) -> IO[str]:
    """Hold an exclusive lock on ``path`` (flock on ``path/.lock``, which names the holder's
    pid) for as long as the returned file stays open: two optimizers writing the same state
    directory would overwrite each other's slots and manifest."""
    f = open(path / LOCK_FILE, "a+")  # noqa: SIM115 (kept open: it is the lock)
    deadline = time.monotonic() + _INHERITED_LOCK_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                if _inherited(path, holder) and time.monotonic() < deadline:
                    time.sleep(0.01)  # a forked child still shares our closed lock: wait
                    continue
                raise
    except BlockingIOError:
        f.close()
        if _inherited(path, holder):
            raise RuntimeError(
                f"{path} is locked by a process forked from this one (pid {holder} is this "
                f"process): it kept a copy of the lock for over {_INHERITED_LOCK_WAIT_S} s "
                "after the optimizer that owned it was closed. Let that child exit, or pass "
                "another path"
            ) from None
        raise RuntimeError(
            f"{path} is in use by another miles_offload optimizer (process {holder}): two "
            "optimizers writing one state directory would overwrite each other's state. "
            "close() the other optimizer (or let its process exit), or pass another path"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            f.close()
            raise
        # A filesystem without flock (some network mounts): run unlocked, and say so.
        warnings.warn(
            f"miles_offload: {path} cannot be locked ({exc.strerror}); nothing stops a second "
            "optimizer from using this directory at the same time",
            RuntimeWarning,
            stacklevel=4,
        )
    except BaseException:
        f.close()
        raise
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _LOCKS.add(f)
    return f


class CpuStore:
    """Every bucket resident in (pinned when CUDA is available) CPU memory."""

    def __init__(self, buckets: list[Bucket], *, pin: bool) -> None:
        self.buckets = buckets
        self._bufs = [aligned_empty(b.nbytes, pin=pin) for b in buckets]
        self.resident_bytes = sum(b.nbytes for b in buckets)
        self.peak_resident_bytes = self.resident_bytes

    def visit(
        self,
        order: list[int],
        fn: VisitFn,
        *,
        read: bool = True,
        write: bool = True,
        reorder: bool = False,
    ) -> None:
        del read, write, reorder  # the buffers are the state
        for i in order:
            fn(self.buckets[i], self._bufs[i])

    def close(self) -> None:
        self._bufs = []


class NvmeStore:
    """Buckets in per-bucket files under ``path``, streamed through `POOL_BUFFERS` buffers.

    Args:
        path: directory for the files (created if missing).
        buckets: the layout.
        descs: per bucket, the segment description stored in (and checked against) headers.
        steps: per parameter, its step tensor (read when a header is written).
        digest: layout digest kept in the manifest.
        resume: open the committed state in ``path`` instead of starting fresh.
        overwrite: start fresh even when ``path`` holds committed state (else an error).
        queue_depth, block_size, backend: `Pager` settings.
        durable: fdatasync the files and fsync the manifest at every commit.
        pin: page-lock the pool buffers (CUDA only).

    Raises:
        ValueError: ``resume`` without a manifest, the manifest is for another layout, or
            committed state without ``resume`` or ``overwrite``.
        CorruptStateError: ``resume`` found a manifest that is not one (the message names the
            file and the field).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        buckets: list[Bucket],
        descs: list[list[dict]],
        steps: list[torch.Tensor],
        digest: str,
        *,
        resume: bool,
        queue_depth: int,
        block_size: int,
        backend: str,
        durable: bool,
        pin: bool,
        overwrite: bool = False,
    ) -> None:
        self.path = Path(path)
        self._overwrite = overwrite
        self.buckets = buckets
        self._descs = descs
        self._steps = steps
        self._durable = durable
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock_dir(self.path)
        try:
            self._setup(buckets, digest, resume, queue_depth, block_size, backend, pin)
        except BaseException:
            self._lock.close()
            raise

    def _setup(
        self,
        buckets: list[Bucket],
        digest: str,
        resume: bool,
        queue_depth: int,
        block_size: int,
        backend: str,
        pin: bool,
    ) -> None:
        self._manifest: dict[str, Any]
        if resume:
            self._manifest = self._load_manifest(digest)
        else:
            self._refuse_committed_state()
            self._manifest = {
                "format": _MANIFEST_FORMAT,
                "version": 1,
                "layout": digest,
                "generation": 0,
                "buckets": [{"slot": 1, "generation": 0} for _ in buckets],
            }
        size = max(b.nbytes for b in buckets)
        self._pool = [aligned_empty(size, pin=pin) for _ in range(min(POOL_BUFFERS, len(buckets)))]
        self.resident_bytes = size * len(self._pool)
        self.peak_resident_bytes = 0
        self._out = 0
        self._out_lock = threading.Lock()
        self._readp = Pager(queue_depth=queue_depth, block_size=block_size, backend=backend)
        self._writep = Pager(queue_depth=queue_depth, block_size=block_size, backend=backend)
        self.backend = self._readp.backend
        self.registered = self._readp.register(self._pool) and self._writep.register(self._pool)
        self._reader = ThreadPoolExecutor(1, "miles-offload-read")
        self._writer = ThreadPoolExecutor(1, "miles-offload-write")
        self._syncer = ThreadPoolExecutor(1, "miles-offload-sync")
        self._syncs: list[Future[None]] = []
        self._fds: dict[tuple[int, int], int] = {}
        # bucket index -> pool buffer holding that bucket's committed bytes (from the last pass)
        self._kept: dict[int, torch.Tensor] = {}
        self.direct = True
        # Test hook: called in the writer thread after each bucket file is written.
        self._after_write: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ files

    def _file(self, i: int, slot: int) -> Path:
        return self.path / f"bucket_{i:06d}.{slot}.bin"

    def _fd(self, i: int, slot: int, *, create: bool) -> int:
        fd = self._fds.get((i, slot))
        if fd is None:
            fd, direct = open_direct(self._file(i, slot), create=create)
            self.direct = self.direct and direct
            self._fds[(i, slot)] = fd
        return fd

    def _refuse_committed_state(self) -> None:
        """Starting fresh over committed state would silently drop it: only on request."""
        mpath = self.path / MANIFEST
        if self._overwrite or not mpath.exists():
            return
        try:
            generation = json.loads(mpath.read_text()).get("generation")
        except (OSError, ValueError, AttributeError):
            generation = None
        what = f"committed at generation {generation}" if isinstance(generation, int) else ""
        raise ValueError(
            f"{self.path} holds optimizer state ({mpath} {what}) and resume=False would "
            f"overwrite it. To continue it pass resume=True; to start over delete the "
            f"directory (rm -r {self.path}), pass another path, or pass overwrite=True"
        )

    def _load_manifest(self, digest: str) -> dict[str, Any]:
        mpath = self.path / MANIFEST
        if not mpath.exists():
            raise ValueError(
                f"resume=True but {mpath} does not exist: no committed optimizer state in "
                f"{self.path}; pass resume=False to start fresh"
            )
        try:
            manifest: dict[str, Any] = json.loads(mpath.read_text())
        except (OSError, ValueError) as exc:
            raise CorruptStateError(f"{mpath}: unreadable manifest ({exc})") from exc
        check_manifest(manifest, mpath)
        if manifest["layout"] != digest or len(manifest["buckets"]) != len(self.buckets):
            raise ValueError(
                f"{self.path} holds optimizer state for another bucket layout (other parameters "
                "or bucket_mb/moment_dtype): build the optimizer with the settings that wrote "
                "it, or move state across layouts with state_dict() / load_state_dict()"
            )
        return manifest

    def _read(self, i: int, buf: torch.Tensor, *, verify: bool = True) -> dict[str, Any]:
        b = self.buckets[i]
        entry = self._manifest["buckets"][i]
        if entry["generation"] == 0:
            raise CorruptStateError(f"bucket {i} of {self.path} was never committed")
        slot = entry["slot"]
        where = str(self._file(i, slot))
        try:
            fd = self._fd(i, slot, create=False)
        except FileNotFoundError as exc:
            raise CorruptStateError(f"{where}: missing bucket file") from exc
        size = os.fstat(fd).st_size
        if size < b.nbytes:
            raise CorruptStateError(
                f"{where}: truncated ({size} bytes, expected {b.nbytes}); the optimizer state "
                "cannot be recovered from this directory"
            )
        n = b.nbytes if verify else b.header_bytes
        crc = self._readp.read(fd, 0, buf[:n], crc_from=b.header_bytes if verify else -1)
        meta = decode_header(buf, b, self._descs[i], where, verify_payload=verify, payload_crc=crc)
        if meta["generation"] != entry["generation"]:
            raise CorruptStateError(
                f"{where}: generation {meta['generation']}, the manifest expects "
                f"{entry['generation']} (a stale or overwritten file)"
            )
        return meta

    def _write(self, i: int, buf: torch.Tensor, generation: int) -> int:
        b = self.buckets[i]
        slot = 1 - self._manifest["buckets"][i]["slot"]
        steps = [float(self._steps[s.param]) for s in b.segments]
        fd = self._fd(i, slot, create=True)
        if os.fstat(fd).st_size != b.nbytes:
            # A new slot file: allocate all of it first (a full disk fails before any write;
            # later steps overwrite these blocks in place).
            try:
                preallocate(fd, b.nbytes)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"miles_offload: cannot allocate {b.nbytes} bytes for {self._file(i, slot)} "
                    f"({exc.strerror}); free space there or pass another path. This step is "
                    "not committed: the previous step's state stays the committed one",
                ) from exc
        # The payload first (the pager checksums it on the way), then the header with that sum.
        payload = buf[b.header_bytes : b.nbytes]
        crc = self._writep.write(fd, b.header_bytes, payload, crc_from=0)
        encode_header(buf, b, self._descs[i], steps, generation, payload_crc=crc)
        self._writep.write(fd, 0, buf[: b.header_bytes])
        if self._durable:
            # In its own thread: the flush overlaps the next bucket's write instead of holding
            # the writer (the buffer is free once the write has completed); the commit waits.
            self._syncs.append(self._syncer.submit(os.fdatasync, fd))
        if self._after_write is not None:
            self._after_write(i)
        return slot

    def read_steps(self) -> dict[int, float]:
        """Per parameter, the step recorded in the committed headers (reads headers only)."""
        out: dict[int, float] = {}
        self._kept.clear()  # the header reads below go through a pool buffer
        buf = self._pool[0]
        for i, b in enumerate(self.buckets):
            meta = self._read(i, buf, verify=False)
            for seg, step in zip(b.segments, meta["steps"]):
                out[seg.param] = float(step)
        return out

    # ------------------------------------------------------------------ the pipeline

    def _take(self, free: queue.Queue[torch.Tensor], abort: threading.Event) -> torch.Tensor:
        while True:
            try:
                buf = free.get(timeout=0.05)
            except queue.Empty:
                if abort.is_set():
                    raise RuntimeError("aborted") from None
                continue
            self._count_out()
            return buf

    def _count_out(self) -> None:
        with self._out_lock:
            self._out += 1
            self.peak_resident_bytes = max(
                self.peak_resident_bytes, self._out * self._pool[0].numel()
            )

    def _give(self, free: queue.Queue[torch.Tensor], buf: torch.Tensor) -> None:
        with self._out_lock:
            self._out -= 1
        free.put(buf)

    def visit(
        self,
        order: list[int],
        fn: VisitFn,
        *,
        read: bool = True,
        write: bool = True,
        reorder: bool = False,
    ) -> None:
        """Run ``fn`` on each bucket of ``order``; with ``write``, commit the results.

        ``read=False`` skips loading (``fn`` must then fill the whole bucket). ``reorder``
        lets the buckets still held from the last pass go first (and unread). On any error
        nothing is committed: the previous state stays the committed one.
        """
        if not order:
            return
        kept, self._kept = self._kept, {}  # valid again only after a successful commit
        if reorder:
            order = [i for i in order if i in kept] + [i for i in order if i not in kept]
        # Held buffers serve the buckets that open the order; the others go back to the pool
        # (a held buffer waiting for a later bucket would starve the reads before it).
        held: dict[int, torch.Tensor] = {}
        for i in order:
            if i not in kept:
                break
            held[i] = kept[i]
        free: queue.Queue[torch.Tensor] = queue.Queue()
        for b in self._pool:
            if not any(b is h for h in held.values()):
                free.put(b)
        abort = threading.Event()
        generation = self._manifest["generation"] + 1
        self._syncs = []
        last: dict[int, int] = {}  # id(pool buffer) -> the bucket last written from it

        def load(i: int) -> torch.Tensor:
            buf = held.pop(i, None)
            if buf is not None:  # already holds bucket i's committed bytes
                self._count_out()
                return buf
            buf = self._take(free, abort)
            try:
                if read:
                    self._read(i, buf)
            except BaseException:
                self._give(free, buf)
                raise
            return buf

        def store(i: int, buf: torch.Tensor) -> int:
            try:
                slot = self._write(i, buf, generation)
                last[id(buf)] = i
                return slot
            finally:
                self._give(free, buf)

        loads = [self._reader.submit(load, i) for i in order]
        stores: list[Future[int]] = []
        try:
            for i, fut in zip(order, loads):
                buf = fut.result()
                try:
                    fn(self.buckets[i], buf)
                except BaseException:
                    self._give(free, buf)
                    raise
                if write:
                    stores.append(self._writer.submit(store, i, buf))
                else:
                    self._give(free, buf)
            slots = [s.result() for s in stores]
            for sync in self._syncs:  # every written file is on stable storage before the commit
                sync.result()
        except BaseException:
            abort.set()
            for f in loads:
                f.cancel()
            pending: list[Future[Any]] = [*loads, *stores]
            for f in pending:  # wait for the I/O threads; the first error is the one raised
                if not f.cancelled():
                    with contextlib.suppress(BaseException):
                        f.result()
            for sync in self._syncs:  # complete now: the stores that queue them have returned
                with contextlib.suppress(BaseException):
                    sync.result()
            raise
        if write:
            self._commit(order, slots, generation)
            self._kept = {last[id(b)]: b for b in self._pool if id(b) in last}

    def _commit(self, order: list[int], slots: list[int], generation: int) -> None:
        manifest = json.loads(json.dumps(self._manifest))
        manifest["generation"] = generation
        for i, slot in zip(order, slots):
            manifest["buckets"][i] = {"slot": slot, "generation": generation}
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            if self._durable:
                os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)
        if self._durable:
            dfd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._manifest = manifest

    def pager_stats(self) -> dict[str, int]:
        """Read and write pager counters added together."""
        r, w = self._readp.stats(), self._writep.stats()
        return {k: r[k] + w[k] for k in r}

    def close(self) -> None:
        """Close the files and stop the I/O threads (the committed state stays on disk)."""
        self._kept.clear()
        self._reader.shutdown()
        self._writer.shutdown()
        self._syncer.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._readp.close()
        self._writep.close()
        self._lock.close()  # releases the directory
