"""Quantizer bandwidth: miles-quant's fused C++ kernels vs the peers, on the same buffers.

Why: rollout-precision export and online activation quantization sit on the weight-update and
inference paths, so a quantizer should run near memory speed. This script measures GB/s
(bytes read + bytes written, per second) for 4096x4096, 8192x7168 and an MoE [E, N, K] weight,
in bf16 (or ``--dtype fp16`` / ``--dtype fp32``), single-threaded and with all threads, and puts
side by side in the same run:

- miles-quant native (fused amax + scale + cast + pack, writing into preallocated outputs with
  ``quantize(..., out=q)``), and optionally its PyTorch reference (same bits);
- the plain dtype casts of torch (``dst.copy_(x)`` into a float8 buffer) and ml_dtypes
  (``np.copyto``), which compute no scale at all;
- torchao's eager quantizers (``to_mx`` for MX formats, ``nvfp4_quantize`` for NVFP4);
- NVIDIA ModelOpt's NVFP4 quantizer (``NVFP4QTensor.quantize``, pure torch) when
  ``nvidia-modelopt`` is importable (not a dependency: run from a scratch venv that has it);
- a measured memcpy of the same input (``dst.copy_(x)``, same dtype) at 1 and all threads.

Every output buffer is written once before timing (first-touch page faults run at about
0.7 GB/s on the project's VMs and would otherwise dominate) and reused. Methods run
interleaved: each repeat times every method once; the table shows the best repeat of each
(least disturbed when the machine is shared; ``--stat median`` for the median, the JSON has
both). It gives ratios to memcpy (same thread count) and to torchao.

Laptop:   python tools/bench/quant_bandwidth.py                # all shapes, ~3-6 min on 2 cores
          python tools/bench/quant_bandwidth.py --quick        # 4096x4096 only, ~1 min
          python tools/bench/quant_bandwidth.py --json out.json --repeat 5
          python tools/bench/quant_bandwidth.py --dtype fp16 --threads 1   # fp16 inputs
Cluster:  CPU only (the CUDA kernels are checked by tools/gpu_checks/quant_cuda_check.sh).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import miles_quant as mq

SHAPES = {"4096x4096": (4096, 4096), "8192x7168": (8192, 7168), "moe8x2048x7168": (8, 2048, 7168)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (label, format, granularity, scale rule)
FORMATS = [
    ("fp8_e4m3 tensor", "fp8_e4m3", "tensor", None),
    ("fp8_e4m3 1x128", "fp8_e4m3", "1x128", None),
    ("fp8_e5m2 tensor", "fp8_e5m2", "tensor", None),
    ("fp8_block128", "fp8_block128", "128x128", None),
    ("mxfp8_e4m3 floor", "mxfp8_e4m3", "1x32", "floor"),
    ("mxfp8_e4m3 rceil", "mxfp8_e4m3", "1x32", "rceil"),
    ("mxfp8_e5m2 floor", "mxfp8_e5m2", "1x32", "floor"),
    ("mxfp4 floor", "mxfp4", "1x32", "floor"),
    ("mxfp4 rceil", "mxfp4", "1x32", "rceil"),
    ("nvfp4 1x16", "nvfp4", "1x16", None),
    ("nvfp4 1x16 static", "nvfp4", "1x16", None),  # a given global scale (global_scale=)
    ("nvfp4 16x16", "nvfp4", "16x16", None),  # 2-D weight scaling (no torchao / ModelOpt peer)
    ("nvfp4 16x16 static", "nvfp4", "16x16", None),
    ("int4_g32", "int4_g32", "1x32", None),
    ("int4_g128", "int4_g128", "1x128", None),
]


@dataclass
class Method:
    """One timed callable and the bytes it reads plus writes per call."""

    name: str
    threads: int
    fn: Callable[[], object]
    nbytes: int
    slow_peer: bool = False  # timed at most --peer-repeat times, no warm-up (allocates anyway)
    times: list[float] = field(default_factory=list)

    def gbps(self, stat: str = "best") -> float:
        t = min(self.times) if stat == "best" else statistics.median(self.times)
        return self.nbytes / t / 1e9


def _nbytes(q: mq.QuantizedTensor) -> int:
    g = 0 if q.global_scale is None else q.global_scale.nbytes
    return q.data.nbytes + q.scales.nbytes + g


def _torchao() -> tuple[Callable[..., object], Callable[..., object], Callable[..., object]] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import (
                nvfp4_quantize,
                per_tensor_amax_to_scale,
            )
    except ImportError:
        return None
    modes = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}

    def mx(x: torch.Tensor, elem: torch.dtype, rule: str) -> object:
        return to_mx(x, elem, 32, modes[rule])

    def nvfp4(x: torch.Tensor, scale: torch.Tensor | None = None) -> object:
        if scale is None:
            scale = per_tensor_amax_to_scale(x.abs().amax().float())
        return nvfp4_quantize(x, 16, scale)

    return mx, nvfp4, per_tensor_amax_to_scale


def _torchao_takes(ao: tuple[Callable[..., object], ...], fmt: str, dtype: torch.dtype) -> bool:
    """Whether torchao's eager quantizer of fmt takes inputs of dtype (a 128x128 probe)."""
    mx, nvfp4, _ = ao
    probe = torch.ones(128, 128, dtype=dtype)
    elem = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn}.get(fmt)
    elem = elem or torch.float8_e5m2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nvfp4(probe) if fmt == "nvfp4" else mx(probe, elem, "floor")
    except Exception:
        return False
    return True


def _modelopt_nvfp4() -> Callable[[torch.Tensor], object] | None:
    """ModelOpt's NVFP4 quantizer (real quantization, pure torch), if installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except ImportError:
        return None
    return lambda x: NVFP4QTensor.quantize(x, 16)


def _ml_dtypes_cast(x: torch.Tensor, fmt: str) -> Callable[[], object] | None:
    try:
        import ml_dtypes
        import numpy as np
    except ImportError:
        return None
    target = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_block128": ml_dtypes.float8_e4m3fn}
    target |= {"mxfp8_e4m3": ml_dtypes.float8_e4m3fn, "mxfp4": ml_dtypes.float4_e2m1fn}
    target |= {"fp8_e5m2": ml_dtypes.float8_e5m2, "mxfp8_e5m2": ml_dtypes.float8_e5m2}
    if fmt not in target:
        return None
    if x.dtype == torch.float32:
        src = x.numpy()
    else:
        view = ml_dtypes.bfloat16 if x.dtype == torch.bfloat16 else np.float16
        src = x.view(torch.int16).numpy().view(view)
    dst = np.empty(src.shape, dtype=target[fmt])
    return lambda: np.copyto(dst, src, casting="unsafe")


def native_call(
    x: torch.Tensor, label: str, fmt: str, gran: str, rule: str | None, **extra: object
) -> tuple[mq.QuantizedTensor, dict[str, object]]:
    """A first result of one bench row on x (the `out=` buffer of the timed calls) and the
    quantize() keywords of its timed calls. A label ending in "static" (NVFP4) passes the global
    scale that first call computed, as a calibrated input_scale: same bits, no amax pass."""
    stacked = x.dim() == 3 and gran in ("tensor", "1x16", "16x16")
    kw: dict[str, object] = {"granularity": gran, "scale_rule": rule, "stacked": stacked, **extra}
    q = mq.quantize(x, fmt, **kw)  # type: ignore[arg-type]
    if label.endswith("static"):
        if fmt != "nvfp4":
            raise ValueError(f"bench row {label!r}: a static row needs format 'nvfp4', not {fmt!r}")
        kw["global_scale"] = q.global_scale
    return q, kw


def methods_for(
    x: torch.Tensor,
    label: str,
    fmt: str,
    gran: str,
    rule: str | None,
    threads: list[int],
    ref: bool,
) -> list[Method]:
    """The timed methods of one format on x: native per thread count, then the peers.
    A "static" label: NVFP4 with the global scale given (computed once beforehand, as a
    calibrated input_scale would be), for miles-quant and torchao alike."""
    ms = []
    q, kw = native_call(x, label, fmt, gran, rule)
    moved = x.nbytes + _nbytes(q)
    static = "global_scale" in kw
    for t in threads:
        native = functools.partial(mq.quantize, x, fmt, threads=t, out=q, **kw)  # type: ignore[arg-type]
        ms.append(Method("native", t, native, moved))
    if ref:
        reference = functools.partial(mq.quantize, x, fmt, backend="torch", **kw)  # type: ignore[arg-type]
        ms.append(Method("reference", threads[-1], reference, moved))
    el = mq.FORMATS[fmt].element
    if el is not None and el.torch_dtype is not None:
        dst = torch.empty(x.shape, dtype=el.torch_dtype)
        for t in threads:
            ms.append(
                Method("torch cast", t, functools.partial(dst.copy_, x), x.nbytes + dst.nbytes)
            )
    cast = _ml_dtypes_cast(x, fmt)
    if cast is not None:
        ms.append(Method("ml_dtypes cast", 1, cast, x.nbytes + x.numel(), slow_peer=True))
    ao = _torchao()
    if ao is not None and mq.FORMATS[fmt].family in ("mx", "nvfp4") and gran != "16x16":
        mx, nvfp4, _ = ao
        x2 = x.reshape(-1, x.shape[-1])
        if fmt == "nvfp4":
            given = ao[2](x2.abs().amax().float()) if static else None
            fn: Callable[[], object] = functools.partial(nvfp4, x2, given)
        else:
            elem = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else el.torch_dtype  # type: ignore[union-attr]
            fn = functools.partial(mx, x2, elem, rule or "floor")
        if _torchao_takes(ao, fmt, x.dtype):
            for t in threads:
                ms.append(Method("torchao eager", t, fn, moved, slow_peer=True))
    modelopt = _modelopt_nvfp4() if fmt == "nvfp4" and gran == "1x16" and not static else None
    if modelopt is not None:
        x2 = x.reshape(-1, x.shape[-1])
        for t in threads:
            ms.append(Method("modelopt", t, functools.partial(modelopt, x2), moved, slow_peer=True))
    return ms


def memcpy_methods(x: torch.Tensor, threads: list[int]) -> list[Method]:
    dst = torch.empty_like(x)
    return [Method("memcpy", t, functools.partial(dst.copy_, x), 2 * x.nbytes) for t in threads]


def run_shape(shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(DTYPES[args.dtype])
    threads = sorted({1, args.threads})
    formats = [f for f in FORMATS if not args.formats or f[1] in args.formats]
    per_format = {label: methods_for(x, label, f, gr, r, threads, args.reference)
                  for label, f, gr, r in formats}  # fmt: skip
    memcpy = memcpy_methods(x, threads)
    out: dict[str, object] = {"shape": list(shape), "dtype": args.dtype}
    return out | time_interleaved(memcpy, per_format, args)


def time_interleaved(
    memcpy: list[Method], per_format: dict[str, list[Method]], args: argparse.Namespace
) -> dict[str, object]:
    """Times every method args.repeat times (slow peers args.peer_repeat times), interleaved,
    after one untimed warm-up call of each fast one; returns the "best" and "median" tables."""
    everything = memcpy + [m for ms in per_format.values() for m in ms]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in everything:  # warm up: allocate and page in every output once
            if not m.slow_peer:
                torch.set_num_threads(m.threads)
                m.fn()
        for r in range(args.repeat):  # interleaved
            for m in everything:
                if m.slow_peer and r >= args.peer_repeat:
                    continue
                torch.set_num_threads(m.threads)
                t0 = time.perf_counter()
                m.fn()
                m.times.append(time.perf_counter() - t0)
    torch.set_num_threads(args.threads)
    out: dict[str, object] = {}
    for stat in ("best", "median"):
        rows = {label: {f"{m.name} {m.threads}t": m.gbps(stat) for m in ms}
                for label, ms in per_format.items()}  # fmt: skip
        out[stat] = {"memcpy": {m.threads: m.gbps(stat) for m in memcpy}, "formats": rows}
    return out


def print_table(res: dict[str, object], threads: list[int], stat: str) -> None:
    shape = "x".join(str(s) for s in res["shape"])  # type: ignore[attr-defined]
    mc: dict[int, float] = res[stat]["memcpy"]  # type: ignore[index]
    memcpy = ", ".join(f"{t}t {v:.1f} GB/s" for t, v in mc.items())
    dtype = res.get("dtype", "bf16")  # type: ignore[attr-defined]
    print(f"\n### {shape} {dtype} ({stat} of the repeats)   memcpy: {memcpy}")
    t1 = threads[0]
    ts = threads if len(threads) == 1 else [threads[0], threads[-1]]  # --threads 1: one column each
    cols = [*(f"native {t}t" for t in ts), f"torch cast {t1}t", f"ml_dtypes cast {t1}t",
            *(f"torchao eager {t}t" for t in ts)]  # fmt: skip
    head = ["format", *[f"{c} GB/s" for c in cols]]
    head += [*(f"native/memcpy {t}t" for t in ts), *(f"native/torchao {t}t" for t in ts),
             f"native/torch cast {t1}t", "native/ml_dtypes"]  # fmt: skip
    rows = res[stat]["formats"].values()  # type: ignore[index]
    modelopt = [f"modelopt {t}t" for t in ts if any(f"modelopt {t}t" in r for r in rows)]
    head += [f"{c} GB/s" for c in modelopt] + [f"native/{c}" for c in modelopt]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for label, row in res[stat]["formats"].items():  # type: ignore[index]
        cells = [label] + [f"{row[c]:.2f}" if c in row else "-" for c in cols]
        cells += [f"{row[f'native {t}t'] / mc[t]:.2f}" for t in ts]
        for t in ts:
            ao = row.get(f"torchao eager {t}t")
            cells.append(f"{row[f'native {t}t'] / ao:.0f}x" if ao else "-")
        for peer in (f"torch cast {t1}t", f"ml_dtypes cast {t1}t"):
            v = row.get(peer)
            cells.append(f"{row[f'native {t1}t'] / v:.1f}x" if v else "-")
        cells += [f"{row[c]:.2f}" if c in row else "-" for c in modelopt]
        for c in modelopt:
            native = row[f"native {c.split()[-1]}"]
            cells.append(f"{native / row[c]:.0f}x" if c in row else "-")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="4096x4096 only")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="input dtype")
    p.add_argument("--formats", nargs="*", default=[], help="format names (default: all)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="'all threads'")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats")
    p.add_argument(
        "--peer-repeat", type=int, default=2,
        help="repeats of the slow peers (torchao eager, ml_dtypes: 10-100x slower)",
    )  # fmt: skip
    p.add_argument("--reference", action="store_true", help="also time the PyTorch reference")
    p.add_argument(
        "--stat", choices=["best", "median"], default="best",
        help="which repeat the table shows (best: least disturbed by other jobs; JSON has both)",
    )  # fmt: skip
    p.add_argument("--json", default="", help="write the results here")
    run_shapes(p.parse_args(), "miles-quant bandwidth", run_shape, print_table)


def run_shapes(
    args: argparse.Namespace,
    title: str,
    run: Callable[[tuple[int, ...], argparse.Namespace], dict[str, object]],
    show: Callable[[dict[str, object], list[int], str], None],
) -> None:
    """Runs `run` on each of args.shapes (4096x4096 only with --quick), prints each result
    with `show`, brackets them with the load average, and writes them to args.json if set."""
    if args.quick:
        args.shapes = ["4096x4096"]
    if not mq.native_available():
        raise SystemExit(f"miles_quant native extension missing: {mq.native_error()}")
    load0 = os.getloadavg()
    print(f"# {title}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average at start {load0[0]:.2f}")  # fmt: skip
    threads = sorted({1, args.threads})
    results = []
    for name in args.shapes:
        res = run(SHAPES[name], args)
        show(res, threads, args.stat)
        results.append(res)
    load1 = os.getloadavg()
    print(f"\nload average at end {load1[0]:.2f} (1 min), {load1[1]:.2f} (5 min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": [load0, load1], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
