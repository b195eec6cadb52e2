"""The pager moves bytes exactly with every backend; io_uring unavailability is detected at run
time (a seccomp filter makes io_uring_setup fail) and the thread pool takes over with a
warning; the environment override forces the fallback; errors are clear."""

from __future__ import annotations

import errno
import os
import platform
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import miles_offload as mo
from miles_offload import _native

NATIVE = pytest.mark.skipif(not _native.available(), reason="native extension not built")


def _roundtrip(tmp_path: Path, backend: str, nbytes: int, qd: int, block: int) -> dict:
    pager = mo.Pager(queue_depth=qd, block_size=block, backend=backend)
    assert pager.backend == backend
    src = mo.aligned_empty(nbytes)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator()))
    fd, _ = mo.open_direct(tmp_path / f"{backend}.bin", create=True)
    try:
        # The fused checksums (computed while the I/O runs) equal a separate pass, from any
        # starting byte, including inside a block.
        skip = 3 * 4096 + 17
        assert pager.write(fd, 8192, src, crc_from=skip) == mo.crc32c(src[skip:])
        dst = mo.aligned_empty(nbytes)
        assert pager.read(fd, 8192, dst, crc_from=0) == mo.crc32c(src)
        assert torch.equal(src, dst)
        assert pager.read(fd, 8192, dst) == 0  # no checksum asked
        assert os.fstat(fd).st_size == 8192 + nbytes
        return pager.stats()
    finally:
        os.close(fd)
        pager.close()


@NATIVE
@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_native_backends_roundtrip(tmp_path: Path, backend: str) -> None:
    if backend == "io_uring" and mo.Pager(backend="auto").backend != "io_uring":
        pytest.skip("io_uring unavailable here")
    # 13 blocks of 64 KiB plus a partial one, 4 in flight.
    stats = _roundtrip(tmp_path, backend, 13 * 65536 + 4096, qd=4, block=65536)
    assert stats["bytes_written"] == 13 * 65536 + 4096
    assert stats["bytes_read"] == 2 * stats["bytes_written"]
    assert stats["requests"] >= 3 * 14
    if backend == "io_uring":
        assert 0 < stats["submit_calls"] < stats["requests"]  # batched submissions


def test_built_with_io_uring_where_liburing_is_installed() -> None:
    # CI installs liburing-dev (make setup): a build that silently lost io_uring would otherwise
    # only skip the io_uring tests. This guard never skips itself in CI (MILES_REQUIRE_NATIVE=1,
    # set by make test): a missing extension or liburing fails it there.
    required = os.environ.get("MILES_REQUIRE_NATIVE", "") == "1"
    if not _native.available():
        if required:  # not reached: importing miles_offload already failed (see _native)
            pytest.fail(f"the native extension did not load: {_native.error()}")
        pytest.skip(f"native extension not built: {_native.error()}")
    if not Path("/usr/include/liburing.h").exists():
        # Where make setup can install it (root with apt, as in CI), missing is a failure:
        # its `apt-get install liburing-dev` must not fail unnoticed.
        if required or (shutil.which("apt-get") and os.geteuid() == 0):
            pytest.fail(
                "liburing-dev is missing although apt-get could install it (make setup tries): "
                "apt-get install liburing-dev, then rebuild the extension with "
                ".venv/bin/pip install --no-deps -e packages/miles-offload"
            )
        pytest.skip("liburing-dev is not installed here")
    assert _native._ext is not None
    assert _native._ext.built_with_io_uring(), (
        "liburing-dev is installed but the extension was built without it: rebuild with "
        ".venv/bin/pip install --no-deps -e packages/miles-offload"
    )


@NATIVE
def test_registered_buffers_use_fixed_requests(tmp_path: Path) -> None:
    if mo.Pager(backend="auto").backend != "io_uring":
        pytest.skip("io_uring unavailable here")
    pager = mo.Pager(queue_depth=4, block_size=65536, backend="io_uring")
    registered, plain = mo.aligned_empty(8 * 65536), mo.aligned_empty(8 * 65536)
    registered.copy_(torch.randint(0, 256, (8 * 65536,), dtype=torch.uint8))
    assert pager.register([registered])
    fd, _ = mo.open_direct(tmp_path / "fixed.bin", create=True)
    try:
        pager.write(fd, 0, registered)  # READ_FIXED/WRITE_FIXED: the whole buffer, and views
        pager.read(fd, 65536, registered[65536:])
        s = pager.stats()
        assert s["requests"] >= 15
        assert s["fixed_requests"] == s["requests"]
        pager.read(fd, 0, plain)  # an unregistered buffer: plain READ requests
        s2 = pager.stats()
        assert s2["requests"] >= s["requests"] + 8
        assert s2["fixed_requests"] == s["fixed_requests"]
        assert torch.equal(plain, registered)
    finally:
        os.close(fd)
        pager.close()


def test_python_backend_roundtrip(tmp_path: Path) -> None:
    stats = _roundtrip(tmp_path, "python", 5 * 65536, qd=3, block=65536)
    assert stats["bytes_read"] == 2 * 5 * 65536


def test_crc32c_known_value_and_python_agrees() -> None:
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert mo.crc32c(data) == 0xE3069283  # the CRC-32C check value
    blob = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    from miles_offload._pager import _crc32c_python, _view

    assert mo.crc32c(blob) == _crc32c_python(_view(blob), 0)
    assert mo.crc32c(blob[50_000:], mo.crc32c(blob[:50_000])) == mo.crc32c(blob)


def test_short_file_and_misaligned_buffers_raise(tmp_path: Path) -> None:
    pager = mo.Pager(queue_depth=2, block_size=4096)
    fd, _ = mo.open_direct(tmp_path / "short.bin", create=True)
    try:
        pager.write(fd, 0, mo.aligned_empty(4096))
        with pytest.raises(OSError, match=r"end of file|No data"):
            pager.read(fd, 0, mo.aligned_empty(3 * 4096))
        with pytest.raises(ValueError, match="aligned to 4096"):
            pager.read(fd, 0, mo.aligned_empty(8192)[1:4097])
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="block_size"):
        mo.Pager(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        mo.Pager(queue_depth=0)


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that contains ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_buffers_sit_on_huge_pages_and_outlive_their_views() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are unavailable here")
    buf = mo.aligned_empty(8 * mo.HUGE_PAGE)
    assert buf.data_ptr() % mo.HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0  # pre-faulted with zeros
    # Physically contiguous 2 MiB pieces (the kernel may fall back for a few under pressure).
    assert _anon_huge_bytes(buf.data_ptr()) >= 4 * mo.HUGE_PAGE
    view = buf[4096:8192]
    del buf  # the mapping lives as long as a view of it
    view.fill_(7)
    assert int(view.sum()) == 7 * 4096
    small = mo.aligned_empty(8192)  # small buffers stay on ordinary pages
    assert small.data_ptr() % mo.ALIGN == 0


def test_preallocate_allocates_keeps_data_and_fails_before_writing(tmp_path: Path) -> None:
    from miles_offload._pager import preallocate

    fd, _ = mo.open_direct(tmp_path / "pre.bin", create=True)
    try:
        # A new file gets every block allocated (not a sparse file), reading as zeros.
        assert preallocate(fd, 1 << 20)
        st = os.fstat(fd)
        assert st.st_size == 1 << 20
        assert st.st_blocks * 512 >= 1 << 20
        pager = mo.Pager(queue_depth=2, block_size=65536)
        data = mo.aligned_empty(65536)
        data.copy_(torch.randint(0, 256, (65536,), dtype=torch.uint8))
        pager.write(fd, 0, data)
        # Growing keeps what was written; shrinking truncates.
        assert preallocate(fd, 3 << 20)
        back = mo.aligned_empty(3 << 20)
        pager.read(fd, 0, back)
        assert torch.equal(back[:65536], data)
        assert int(back[65536:].count_nonzero()) == 0
        assert preallocate(fd, 65536)
        assert os.fstat(fd).st_size == 65536
        # No room (here: the file-size limit; Python ignores SIGXFSZ): an OSError, nothing grown.
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 17, hard))
        try:
            with pytest.raises(OSError, match="File too large") as info:
                preallocate(fd, 1 << 20)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert info.value.errno == errno.EFBIG
        assert os.fstat(fd).st_size == 65536
        pager.close()
    finally:
        os.close(fd)


@NATIVE
def test_env_override_forces_the_thread_pool(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import warnings, miles_offload as mo
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            p = mo.Pager()
        print(p.backend, "|", p.fallback_reason, "|", len(w))
        """
    )
    env = dict(os.environ, MILES_OFFLOAD_PAGER="threads")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    backend, reason, warned = (x.strip() for x in out.split("|"))
    assert backend == "threads"
    assert warned == "0"  # asked for: no fallback warning
    if _native._ext is not None and _native._ext.built_with_io_uring():
        assert reason == "io_uring disabled by the caller"
    # A value that is not a backend is refused with the list of valid ones.
    env["MILES_OFFLOAD_PAGER"] = "uring"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "MILES_OFFLOAD_PAGER must be one of ('io_uring', 'threads', 'python')" in bad.stderr


# A seccomp filter that fails io_uring_setup (x86-64 syscall 425) with ENOSYS, as container
# runtimes do: the pager must detect it when io_uring_queue_init fails, warn, and fall back.
_SECCOMP = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
ins = [
    (0x20, 0, 0, 0),                      # ld [nr]
    (0x15, 0, 1, 425),                    # jeq io_uring_setup
    (0x06, 0, 0, 0x00050000 | 38),        # ret ERRNO(ENOSYS)
    (0x06, 0, 0, 0x7FFF0000),             # ret ALLOW
]
raw = b"".join(struct.pack("HBBI", *i) for i in ins)
buf = ctypes.create_string_buffer(raw, len(raw))
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
prog = Prog(len(ins), ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0                       # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP filter
"""


@NATIVE
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter uses x86-64 numbers")
def test_io_uring_failure_is_detected_and_falls_back(tmp_path: Path) -> None:
    code = _SECCOMP + textwrap.dedent(
        f"""
        import warnings, torch, miles_offload as mo
        from pathlib import Path
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            params = [torch.randn(5000, requires_grad=True)]
            opt = mo.AdamW(params, offload="nvme", path={str(tmp_path)!r}, bucket_mb=0.01)
            params[0].grad = torch.ones(5000)
            opt.step()
        print("BACKEND", opt.io_stats()["backend"])
        print("WARN", [str(x.message) for x in w])
        try:
            mo.Pager(backend="io_uring")
        except RuntimeError as e:
            print("STRICT", e)
        """
    )
    env = dict(os.environ)
    env.pop("MILES_OFFLOAD_PAGER", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "BACKEND threads" in out
    assert "io_uring unavailable (io_uring_queue_init failed: Function not implemented)" in out
    assert "STRICT miles_offload: io_uring is unavailable" in out


def test_without_the_extension_everything_still_works(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import warnings, torch, miles_offload as mo
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            params = [torch.randn(3000, requires_grad=True)]
            ref = [params[0].detach().clone().requires_grad_()]
            opt = mo.AdamW(params, offload="nvme", path={str(tmp_path)!r}, bucket_mb=0.01)
            t = torch.optim.AdamW(ref, foreach=False)
            for k in range(3):
                params[0].grad = torch.full((3000,), k + 1.0)
                ref[0].grad = torch.full((3000,), k + 1.0)
                opt.step(); t.step()
        assert torch.equal(params[0], ref[0])
        print(mo.native_available(), opt.io_stats()["backend"], len(w) >= 1)
        """
    )
    env = dict(os.environ, MILES_OFFLOAD_DISABLE_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "python", "True"]
