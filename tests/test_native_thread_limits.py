"""The native extensions survive a thread that cannot be started.

Under a pids limit (containers, CI runners with many ranks) `pthread_create` fails with EAGAIN and
`std::thread` throws. Before the fix, miles-quant's parallel_for let that exception unwind past
threads it had already started: a joinable `std::thread` destroyed by unwinding calls
`std::terminate`, which aborted the whole process ("terminate called without an active
exception", SIGABRT; seen once in CI, in a two-rank QAT run). Each package now gives the work of a
thread that did not start to the threads that did (or to the caller's thread).

The test interposes `pthread_create` with LD_PRELOAD (a 20-line C shim compiled here): after
`budget(n)`, n more threads start and every later one fails with EAGAIN. The work runs in a child
process so that an abort fails the test instead of killing pytest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>

static int budget = -1; /* threads that may still start; -1: no limit */

void miles_test_thread_budget(int n) { __atomic_store_n(&budget, n, __ATOMIC_SEQ_CST); }

int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  typedef int (*create_fn)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static create_fn real;
  if (!real) real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
  for (;;) {
    int b = __atomic_load_n(&budget, __ATOMIC_SEQ_CST);
    if (b < 0) break;
    if (b == 0) return EAGAIN;
    if (__atomic_compare_exchange_n(&budget, &b, b - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
      break;
  }
  return real(t, a, f, arg);
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the pthread_create shim")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM)
    out = d / "libthread_budget.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(d / "shim.c"), "-ldl"],
        check=True,
        capture_output=True,
    )
    return out


def _run(shim: Path, body: str) -> subprocess.CompletedProcess[str]:
    prelude = textwrap.dedent(
        f"""
        import ctypes
        import torch
        torch.set_num_threads(1)
        budget = ctypes.CDLL({str(shim)!r}).miles_test_thread_budget
        """
    )
    env = dict(os.environ, LD_PRELOAD=str(shim))
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _check(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert "OK" in proc.stdout


def test_quantize_when_threads_cannot_start(shim: Path) -> None:
    mq = pytest.importorskip("miles_quant")
    if not mq.native_available():
        pytest.skip(f"miles-quant native extension not built: {mq.native_error()}")
    _check(
        _run(
            shim,
            """
        import miles_quant as mq
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 4096, generator=g).to(torch.bfloat16)
        for fmt in ("mxfp8_e4m3", "nvfp4", "int4_g128", "fp8_block128"):
            ref = mq.quantize(x, fmt, backend="native", threads=1)
            for n in (0, 1, 2):  # threads that start: none, one, two of the seven asked for
                budget(n)
                got = mq.quantize(x, fmt, backend="native", threads=8)
                budget(-1)
                assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8)), fmt
                assert torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8)), fmt
        print("OK")
        """,
        )
    )


def test_transfer_copy_when_threads_cannot_start(shim: Path) -> None:
    mt = pytest.importorskip("miles_transfer.p2p")
    if not mt.reshard_native_available():
        pytest.skip(f"miles-transfer native extension not built: {mt.reshard_native_error()}")
    _check(
        _run(
            shim,
            """
        from miles_transfer.p2p import CopyOp, copy_ops
        src = torch.arange(4096 * 1024, dtype=torch.float32).reshape(4096, 1024)
        op = CopyOp("w", (0, 0), (4096, 1000), 0, "w", (4096, 1024), (0, 0),
                    0, "w", (4096, 1000), (0, 0), 4)
        for n in (0, 1, 2):
            dst = torch.zeros(4096, 1000)
            budget(n)
            copy_ops([op], {"w": src}, {"w": dst}, backend="native", threads=8)
            budget(-1)
            assert torch.equal(dst, src[:, :1000])
        print("OK")
        """,
        )
    )


def test_pager_when_threads_cannot_start(shim: Path, tmp_path: Path) -> None:
    mo = pytest.importorskip("miles_offload")
    try:
        mo.Pager(backend="threads").close()
    except RuntimeError as e:  # the native pager is not built
        pytest.skip(str(e))
    _check(
        _run(
            shim,
            f"""
        import os
        from miles_offload import Pager, aligned_empty, open_direct
        path = {str(tmp_path / "f.bin")!r}
        fd, _ = open_direct(path, create=True)
        buf = aligned_empty(1 << 22)
        buf.copy_(torch.randint(0, 256, (1 << 22,), dtype=torch.uint8))
        back = aligned_empty(1 << 22)
        budget(1)  # one of the eight workers starts: the pager works, with less parallelism
        p = Pager(queue_depth=8, block_size=1 << 16, backend="threads")
        budget(-1)
        p.write(fd, 0, buf)
        p.read(fd, 0, back)
        assert torch.equal(back, buf)
        p.close()
        budget(0)  # none starts: a clear error, not an abort
        try:
            Pager(queue_depth=8, block_size=1 << 16, backend="threads")
        except RuntimeError as e:
            print("refused:", e)
        else:
            raise AssertionError("a pager without a worker thread was created")
        budget(-1)
        os.close(fd)
        print("OK")
        """,
        )
    )
