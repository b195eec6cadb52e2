"""The colocated GPU update path on one GPU: CUDA IPC payloads opened in a second process.

Why: an SGLang engine that shares the trainer's GPUs gets its weights as CUDA IPC handles
(``miles_transfer.push.ColocatedReceiver``), and nothing CUDA runs on the CPU machines. This
builds payloads from CUDA tensors (``serialize_cuda_ipc``), checks them with cuda-python in the
sending process (``push.cuda_runtime.check_payload``: device UUID, cudaMalloc memory, allocation
base), then opens them in a second process twice: by raw handle with cuda-python
(``cudaIpcOpenEventHandle`` + ``cudaIpcOpenMemHandle`` + ``cudaMemcpy``, ``read_span``) and as
SGLang does (torch's rebuild, device by UUID, ``open_cuda_ipc``). Every tensor's bytes must equal
the sender's bit for bit. Figures: bytes, the sender's pack time, the reader's open+copy time
against torch's own device-to-host copy of the same bytes (the copy bound). Each step prints
PASS or FAIL; the exit status is the number of FAILs. Under a minute.

    bash tools/gpu_checks/transfer_cuda_ipc_check.sh            # on a GPU machine
    python tools/gpu_checks/transfer_cuda_ipc_check.py --dry-run-cpu   # here: the same steps,
        # CPU tensors through shared memory (serialize_named_tensors) instead of CUDA IPC

Needs (GPU): a CUDA torch, ``pip install 'miles-transfer[cuda]'`` (cuda-python), miles-transfer
importable (the .sh puts packages/miles-transfer/src on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import traceback
from typing import Any

import torch

FAILS = 0
FORMATS: tuple[str | None, ...] = ("flattened_bucket", None)


def step(name: str, ok: bool, detail: str = "") -> None:
    global FAILS
    FAILS += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def make_tensors(mib: float, device: str) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, random bits (NaN patterns included in bf16), one strided slice
    whose storage starts inside a bigger allocation (a non-zero storage offset)."""
    g = torch.Generator().manual_seed(0)
    n = max(1, int(mib * 2**20) // 2 // 4)  # four big tensors of about mib/4 MiB
    big = torch.randn(2 * n + 7, generator=g).to(device)
    named = [
        ("embed.bf16", torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16)
         .view(torch.bfloat16).to(device)),
        ("mlp.f32", torch.randn(n // 2, generator=g).reshape(-1, 2).to(device)),
        ("slice.f32", big[n + 7 : n + 7 + n // 2]),  # storage offset != 0
        ("norm.fp16", torch.randn(4097, generator=g).half().to(device)),
        ("count.i64", torch.arange(1000, device=device)),
        ("empty.f32", torch.empty(0, 3, device=device)),
    ]  # fmt: skip
    return named


def digests(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    from miles_transfer import tensor_digest

    return {name: tensor_digest(t.detach().cpu()) for name, t in named}


# --- readers: run in a second (spawned) process ---------------------------------------------------


def read_raw_cuda(text: str, load_format: str | None) -> tuple[dict[str, str], float]:
    """Every span through its raw IPC handle with cuda-python (no torch CUDA call)."""
    from miles_transfer import tensor_digest
    from miles_transfer.push.cuda_ipc import describe_cuda_ipc
    from miles_transfer.push.cuda_runtime import read_span

    t0 = time.perf_counter()
    raw = {s.name: (s, read_span(s)) for s in describe_cuda_ipc(text, load_format=load_format)}
    seconds = time.perf_counter() - t0
    out = {}
    for name, (span, data) in raw.items():
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
        out[name] = tensor_digest(t.view(span.dtype).reshape(span.shape))
    return out, seconds


def read_torch_cuda(text: str, load_format: str | None) -> tuple[dict[str, str], float]:
    """As SGLang's TP worker does: torch's rebuild, the device resolved from its UUID."""
    from miles_transfer.push.cuda_ipc import open_cuda_ipc

    t0 = time.perf_counter()
    named = [(n, t.cpu()) for n, t in open_cuda_ipc(text, load_format=load_format)]
    seconds = time.perf_counter() - t0
    return digests(named), seconds


def read_cpu_shm(text: str, load_format: str | None) -> tuple[dict[str, str], float]:
    """The CPU twin (dry run): open the shared-memory payload as SGLang does on CPU."""
    from miles_transfer.push import deserialize_named_tensors

    t0 = time.perf_counter()
    named = [(n, t.clone()) for n, t in deserialize_named_tensors(text, load_format=load_format)]
    seconds = time.perf_counter() - t0
    return digests(named), seconds


def in_child(ctx: Any, fn: Any, text: str, load_format: str | None) -> tuple[dict, float]:
    # A fresh process per reader: a process maps a given CUDA IPC handle only once.
    with ctx.Pool(1) as pool:
        return pool.apply(fn, (text, load_format))


# --- the check -----------------------------------------------------------------------------------


def copy_bound(named: list[tuple[str, torch.Tensor]]) -> float:
    """Seconds for torch's own device-to-host copy of the same tensors (pageable host memory,
    what read_span copies into): the bound a reader's open+copy is compared with."""
    for _, t in named:
        t.cpu()  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _, t in named:
        t.cpu()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def check_cuda_python() -> None:
    try:
        from miles_transfer.push.cuda_runtime import runtime

        rt = runtime()
    except ImportError as e:
        step("cuda-python importable", False, str(e))
        return
    err, count = rt.cudaGetDeviceCount()
    step("cuda-python importable", True, f"cudaGetDeviceCount -> {err!r}, {count}")


def run_gpu(args: argparse.Namespace) -> None:
    from miles_transfer.push import serialize_cuda_ipc
    from miles_transfer.push.cuda_ipc import device_uuid as torch_uuid
    from miles_transfer.push.cuda_runtime import check_payload, device_uuid

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    check_cuda_python()
    step("device UUID: cuda-python == torch", device_uuid(0) == torch_uuid(0), device_uuid(0))
    ctx = mp.get_context("spawn")
    named = make_tensors(args.mib, "cuda")
    want = digests(named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    bound = copy_bound(named)
    print(f"payload: {len(named)} tensors, {nbytes / 2**20:.1f} MiB; torch D2H copy "
          f"{bound * 1e3:.1f} ms ({nbytes / bound / 1e9:.1f} GB/s)", flush=True)  # fmt: skip
    for load_format in FORMATS:
        for device_ref in ("uuid", "index"):
            label = f"{load_format or 'list'}/{device_ref}"
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                payload = serialize_cuda_ipc(named, load_format=load_format, device_ref=device_ref)
                torch.cuda.synchronize()
                pack_s = time.perf_counter() - t0
                check_payload(payload)
                step(f"{label} check_payload (cuda-python)", True,
                     f"{len(payload.storages)} storage(s), pack {pack_s * 1e3:.1f} ms, "
                     f"text {len(payload.text)} chars")  # fmt: skip
                for reader in (read_raw_cuda, read_torch_cuda):
                    got, secs = in_child(ctx, reader, payload.text, load_format)
                    bad = sorted(k for k in want if got.get(k) != want[k])
                    detail = (
                        f"{secs * 1e3:.1f} ms ({nbytes / secs / 1e9:.2f} GB/s, "
                        f"{secs / bound:.2f}x the D2H copy)" + (f"; differ: {bad}" if bad else "")
                    )
                    ok = not bad and set(got) == set(want)
                    step(f"{label} {reader.__name__} in a second process, bit for bit", ok, detail)
                del payload
                torch.cuda.ipc_collect()
            except Exception as e:  # report and go on with the next variant
                traceback.print_exc()
                step(f"{label}", False, f"{type(e).__name__}: {e}")
    # An engine on torch <= 2.12 reads version-2 handles: the rewritten payload still opens.
    try:
        payload = serialize_cuda_ipc(named, handle_version=2)
        got, _ = in_child(ctx, read_raw_cuda, payload.text, "flattened_bucket")
        step("handle_version=2 payload opens by raw handle", got == want)
    except Exception as e:
        traceback.print_exc()
        step("handle_version=2 payload", False, f"{type(e).__name__}: {e}")


def run_cpu(args: argparse.Namespace) -> None:
    """The same steps on CPU tensors through shared memory: the script's plumbing, the second
    process and the bit-for-bit comparison, where no GPU exists."""
    from miles_transfer.push import serialize_named_tensors

    print(f"torch {torch.__version__}, dry run on the CPU (no CUDA IPC)", flush=True)
    check_cuda_python()
    named = make_tensors(args.mib, "cpu")
    want = digests(named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    for _, t in named:
        t.clone()  # warm
    t0 = time.perf_counter()
    for _, t in named:
        t.clone()
    bound = time.perf_counter() - t0
    print(f"payload: {len(named)} tensors, {nbytes / 2**20:.1f} MiB; torch clone "
          f"{bound * 1e3:.1f} ms ({nbytes / bound / 1e9:.1f} GB/s)", flush=True)  # fmt: skip
    for load_format in FORMATS:
        label = load_format or "list"
        t0 = time.perf_counter()
        text = serialize_named_tensors(named, load_format=load_format, consumers=1)
        pack_s = time.perf_counter() - t0
        # The pool starts after the sender's torch_shm_manager: it inherits none of its pipes.
        ctx = mp.get_context("spawn")
        got, secs = in_child(ctx, read_cpu_shm, text, load_format)
        bad = sorted(k for k in want if got.get(k) != want[k])
        step(f"{label} shared memory in a second process, bit for bit",
             not bad and set(got) == set(want),
             f"pack {pack_s * 1e3:.1f} ms, open+copy {secs * 1e3:.1f} ms "
             f"({secs / bound:.2f}x a clone)" + (f"; differ: {bad}" if bad else ""))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run-cpu", action="store_true", help="CPU tensors, shared memory")
    ap.add_argument("--mib", type=float, default=None, help="payload size (256 GPU, 8 CPU)")
    args = ap.parse_args()
    if args.mib is None:
        args.mib = 8.0 if args.dry_run_cpu else 256.0
    if not args.dry_run_cpu and not torch.cuda.is_available():
        step("setup", False, "no CUDA device (a CUDA torch and a GPU; --dry-run-cpu runs here)")
        return 1
    try:
        (run_cpu if args.dry_run_cpu else run_gpu)(args)
    except Exception as e:
        traceback.print_exc()
        step("check", False, f"{type(e).__name__}: {e}")
    print(f"{'ALL PASS' if FAILS == 0 else f'{FAILS} FAIL(S)'}", flush=True)
    return FAILS


if __name__ == "__main__":
    sys.exit(main())
