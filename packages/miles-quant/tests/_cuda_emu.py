"""The CUDA kernels (native/quant/cuda/quantize.cu) on the CPU emulator (native/quant/cuda/emu):
quantize.cu compiled by g++ with -DMQ_CUDA_EMU, each CUDA thread a fiber, behind the CUDA
binding's own calls (bindings/cuda_calls.h) exported for ctypes. `EmulatedCudaModule` has the
four functions of miles_quant._ext_cuda with their signatures and errors, so that
miles_quant._native can be pointed at it (as test_cuda.py does with the real module) and the
kernels run on CPU tensors, whose addresses stand for device addresses."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[3] / "native" / "quant"

# The contract's flags, as for the CPU kernels (native/quant/CMakeLists.txt: MQ_STRICT_FP_FLAGS).
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas", "-Wno-sign-compare"]

I64, INT, U64, BOOL = ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_bool
SIGNATURES = {
    "quantize_fp8": [U64, I64, INT, I64, I64, I64, I64, I64, BOOL, INT, U64, I64, U64, I64, U64],
    "quantize_mx": [U64, I64, INT, I64, I64, INT, INT, U64, I64, U64, I64, U64],
    "quantize_nvfp4": [U64, I64, INT, I64, I64, I64, BOOL, U64, I64, U64, I64, U64, I64, U64, BOOL],
    "quantize_int4": [U64, I64, INT, I64, I64, I64, INT, U64, I64, U64, I64, U64],
}


def compiler() -> str | None:
    """g++ on Linux (the emulator's stack switch is ELF assembly on x86-64, glibc ucontext
    elsewhere), else None: the emulator's tests skip."""
    return shutil.which("g++") if sys.platform.startswith("linux") else None


def asan_runtime() -> str | None:
    """The path of g++'s AddressSanitizer runtime (to preload), or None."""
    cxx = compiler()
    if cxx is None:
        return None
    r = subprocess.run(
        [cxx, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    )
    path = Path(r.stdout.strip())
    found = r.returncode == 0 and path.is_absolute() and path.exists()
    return str(path.resolve()) if found else None


def build(out_dir: Path, asan: bool = False) -> Path:
    """Compiles the emulated kernels and the binding's calls into out_dir/libmq_cuda_emu.so
    (with asan: instrumented by AddressSanitizer, whose runtime must then be preloaded)."""
    cxx = compiler()
    assert cxx is not None, "g++ not found"
    lib = out_dir / "libmq_cuda_emu.so"
    sanitize = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"] if asan else []
    cmd = [
        cxx, *FLAGS, *WARNINGS, *sanitize, "-DMQ_CUDA_EMU",
        f"-I{NATIVE / 'cuda' / 'emu'}", f"-I{NATIVE / 'include'}", f"-I{NATIVE / 'cuda'}",
        "-x", "c++", str(NATIVE / "cuda" / "quantize.cu"),
        "-x", "none", str(NATIVE / "cuda" / "emu" / "emu_capi.cpp"),
        "-o", str(lib),
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-6000:]
    return lib


class EmulatedCudaModule:
    """miles_quant._ext_cuda's four calls over the emulated kernels: ValueError where the binding
    raises it (a buffer of the wrong size), RuntimeError for a failed launch (with the
    emulator's reason: a shuffle a lane never reaches, a deadlocked barrier, a bad grid)."""

    def __init__(self, lib: Path) -> None:
        self._lib = ctypes.CDLL(str(lib))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self._lib, f"mq_emu_{name}")
            fn.argtypes = [*argtypes, ctypes.c_char_p, INT]
            fn.restype = INT
            setattr(self, name, self._wrap(fn))

    @staticmethod
    def _wrap(fn: ctypes._CFuncPtr) -> object:  # type: ignore[name-defined]
        def call(*args: object) -> None:
            err = ctypes.create_string_buffer(1024)
            rc = fn(*args, err, len(err))
            if rc == 1:
                raise ValueError(err.value.decode())
            if rc == 2:
                raise RuntimeError(err.value.decode())
            assert rc == 0, rc

        return call
