"""Dequantization bandwidth: miles-quant's native kernels vs the peers, on the same buffers.

Why: every INT4 QAT forward is quantize-then-dequantize of each selected weight, a quantized
checkpoint read back (`load_quantized`) dequantizes every tensor, and a round-trip check
dequantizes what it exported. This script measures GB/s (bytes read: codes and scales, plus
bytes written: the output, per second) for 4096x4096, 8192x7168 and an MoE [E, N, K] weight
quantized from bf16, dequantized to bf16 (``--dtype`` for float32 / float16), single-threaded
and with all threads, side by side in the same run with:

- miles-quant's PyTorch reference (``backend="torch"``, the same bits; torch ops);
- torchao's eager dequantization where it has the format (``to_dtype`` of MX,
  ``NVFP4Tensor.dequantize``), on torchao's own quantization of the same input;
- the plain torch cast of the FP8 codes to the output dtype (``dst.copy_(q.data)``, no scale);
- a memcpy of a buffer the size of the output (``dst.copy_(src)``): writing the output is most
  of the traffic.

Every output buffer is written once before timing and reused (``out=``). Methods run
interleaved; the table shows the best repeat of each (``--stat median`` for the median).

    python tools/bench/quant_dequant.py                 # all shapes, ~2-4 min on 2 cores
    python tools/bench/quant_dequant.py --quick         # 4096x4096 only
    python tools/bench/quant_dequant.py --dtype float32 --json out.json
    python tools/bench/quant_dequant.py --qat           # one INT4 QAT forward, native vs torch ops
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import miles_quant as mq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_bandwidth import SHAPES, Method, _nbytes, run_shapes, time_interleaved

OUT = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# (label, format, granularity, scale rule)
ROWS = [
    ("fp8_e4m3 tensor", "fp8_e4m3", "tensor", None),
    ("fp8_e4m3 1x128", "fp8_e4m3", "1x128", None),
    ("fp8_block128", "fp8_block128", "128x128", None),
    ("mxfp8_e4m3", "mxfp8_e4m3", "1x32", "floor"),
    ("mxfp4", "mxfp4", "1x32", "floor"),
    ("nvfp4 1x16", "nvfp4", "1x16", None),
    ("nvfp4 16x16", "nvfp4", "16x16", None),
    ("int4_g32", "int4_g32", "1x32", None),
    ("int4_g128", "int4_g128", "1x128", None),
]


def _torchao_dequant(x: torch.Tensor, fmt: str, out: torch.dtype) -> Callable[[], object] | None:
    """torchao's eager dequantization of its own quantization of x, where it has the format."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except ImportError:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if fmt in ("mxfp8_e4m3", "mxfp4"):
        elem = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
        scale, data = to_mx(x2, elem, 32)
        return functools.partial(to_dtype, data, scale, elem, 32, out)
    if fmt == "nvfp4":
        t = NVFP4Tensor.to_nvfp4(x2)
        return functools.partial(t.dequantize, out)
    return None


def methods_for(
    x: torch.Tensor, fmt: str, gran: str, rule: str | None, out: torch.dtype, threads: list[int]
) -> list[Method]:
    stacked = x.dim() == 3 and gran in ("tensor", "1x16", "16x16")
    q = mq.quantize(x, fmt, granularity=gran, scale_rule=rule, stacked=stacked)
    dst = torch.empty(x.shape, dtype=out)
    moved = _nbytes(q) + dst.nbytes
    ms = [
        Method("native", t, functools.partial(mq.dequantize, q, out, threads=t, out=dst), moved)
        for t in threads
    ]
    ref = functools.partial(mq.dequantize, q, out, backend="torch")
    ms.append(Method("reference", 1, ref, moved, slow_peer=True))
    if q.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cast_dst = torch.empty(x.shape, dtype=out)
        cast = functools.partial(cast_dst.copy_, q.data)
        ms.append(Method("torch cast", 1, cast, q.data.nbytes + cast_dst.nbytes))
    ao = _torchao_dequant(x, fmt, out) if gran != "16x16" else None
    if ao is not None:
        ms.append(Method("torchao eager", 1, ao, moved, slow_peer=True))
    return ms


def run_shape(shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    out = OUT[args.dtype]
    threads = sorted({1, args.threads})
    rows = [r for r in ROWS if not args.formats or r[1] in args.formats]
    per_row = {label: methods_for(x, f, gr, ru, out, threads) for label, f, gr, ru in rows}
    src, dst = torch.empty(shape, dtype=out), torch.empty(shape, dtype=out)
    src.fill_(1.0)
    copy = functools.partial(dst.copy_, src)
    memcpy = [Method("memcpy", t, copy, 2 * dst.nbytes) for t in threads]
    res: dict[str, object] = {"shape": list(shape), "out_dtype": args.dtype}
    return res | time_interleaved(memcpy, per_row, args)


def print_table(res: dict[str, object], threads: list[int], stat: str) -> None:
    shape = "x".join(str(s) for s in res["shape"])  # type: ignore[attr-defined]
    mc: dict[int, float] = res[stat]["memcpy"]  # type: ignore[index]
    memcpy = ", ".join(f"{t}t {v:.1f} GB/s" for t, v in mc.items())
    print(f"\n### {shape} bf16 -> {res['out_dtype']} ({stat} of the repeats)   "
          f"memcpy of the output size: {memcpy}")  # fmt: skip
    ts = threads if len(threads) == 1 else [threads[0], threads[-1]]
    cols = [*(f"native {t}t" for t in ts), "reference 1t", "torchao eager 1t", "torch cast 1t"]
    head = ["format", *(f"{c} GB/s" for c in cols), *(f"native/memcpy {t}t" for t in ts),
            "native/reference 1t", "native/torchao 1t", "native/torch cast 1t"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for label, row in res[stat]["formats"].items():  # type: ignore[index]
        cells = [label] + [f"{row[c]:.2f}" if c in row else "-" for c in cols]
        cells += [f"{row[f'native {t}t'] / mc[t]:.2f}" for t in ts]
        for peer in ("reference 1t", "torchao eager 1t", "torch cast 1t"):
            v = row.get(peer)
            cells.append(f"{row['native 1t'] / v:.1f}x" if v else "-")
        print("| " + " | ".join(cells) + " |")


def qat_forward(repeat: int) -> None:
    """One INT4 QAT forward (fake_quantize_int4, group 128) of a 4096x4096 bf16 weight on one
    thread, against the same forward with the torch-ops dequantize (what it ran before the
    native kernels). The previous output stays alive while the next is made, as in training,
    so each call writes a fresh output buffer (first-touch page faults included)."""
    from miles_quant.qat import fake_quantize_int4

    torch.set_num_threads(1)
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w.requires_grad_(True)

    def torch_ops() -> torch.Tensor:
        q = mq.quantize(w.detach(), "int4_g128")
        return mq.dequantize(q, torch.bfloat16, backend="torch")

    best = {}
    for name, fn in (("native", lambda: fake_quantize_int4(w)), ("torch ops", torch_ops)):
        keep = fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            y = fn()
            times.append(time.perf_counter() - t0)
            keep = y
        del keep
        best[name] = min(times) * 1e3
    print(f"\n# INT4 QAT forward, 4096x4096 bf16, one thread: native {best['native']:.1f} ms, "
          f"with the torch-ops dequantize {best['torch ops']:.1f} ms "
          f"({best['torch ops'] / best['native']:.1f}x)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="4096x4096 only")
    p.add_argument("--dtype", choices=list(OUT), default="bfloat16", help="output dtype")
    p.add_argument("--formats", nargs="*", default=[], choices=sorted({r[1] for r in ROWS}))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="'all threads'")
    p.add_argument("--repeat", type=int, default=5, help="interleaved repeats")
    p.add_argument("--peer-repeat", type=int, default=1, help="repeats of the slow peers")
    p.add_argument("--stat", choices=["best", "median"], default="best")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--qat", action="store_true", help="only time one INT4 QAT forward")
    args = p.parse_args()
    if args.qat:
        qat_forward(args.repeat)
        return
    run_shapes(args, "miles-quant dequantize", run_shape, print_table)


if __name__ == "__main__":
    main()
