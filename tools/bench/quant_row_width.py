"""Quantizer speed against row width: the same number of bf16 elements as rows of K columns.

Why: the native kernels vectorize along a row (batches of 16 whole blocks, tiles of 128), so a
narrow or very wide row can fall off their fast loops; the bandwidth bench (quant_bandwidth.py)
only times 4096- and 7168-column rows. This one times every format at several K on one
thread, with a single-threaded memcpy of the same buffer (``dst.copy_(x)``) in the same run,
and prints ns per element and the ratio to memcpy in the bandwidth bench's byte count (bytes
read plus written).

    python tools/bench/quant_row_width.py                       # K = 128 ... 18432
    python tools/bench/quant_row_width.py --cols 384 768 --repeat 9
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from quant_bandwidth import FORMATS, _nbytes, native_call

import miles_quant as mq


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cols", nargs="*", type=int, default=[128, 256, 384, 768, 1536, 7168, 18432])
    p.add_argument("--elements", type=int, default=1 << 24, help="per input (default 2^24)")
    p.add_argument("--formats", nargs="*", choices=sorted({f[1] for f in FORMATS}))
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [f for f in FORMATS if not args.formats or f[1] in args.formats]
    g = torch.Generator().manual_seed(0)
    print(f"# ns per bf16 element (best of {args.repeat}), one thread; [x/memcpy 1t]")
    print("| format | " + " | ".join(f"K={k}" for k in args.cols) + " |")
    print("| --- " * (len(args.cols) + 1) + "|")
    xs = {}
    for k in args.cols:
        xs[k] = torch.randn(max(1, args.elements // k), k, generator=g).to(torch.bfloat16)
    memcpy = {}
    for k, x in xs.items():
        dst = torch.empty_like(x)
        memcpy[k] = 2 * x.nbytes / _best(lambda dst=dst, x=x: dst.copy_(x), args.repeat)
    print("| memcpy 1t GB/s | " + " | ".join(f"{memcpy[k] / 1e9:.1f}" for k in args.cols) + " |")
    for label, fmt, gran, rule in rows:
        cells = []
        for k, x in xs.items():
            q, kw = native_call(x, label, fmt, gran, rule)
            call = functools.partial(mq.quantize, x, fmt, threads=1, out=q, **kw)  # type: ignore[arg-type]
            t = _best(call, args.repeat)
            gbps = (x.nbytes + _nbytes(q)) / t
            cells.append(f"{t * 1e9 / x.numel():.3f} [{gbps / memcpy[k]:.2f}]")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
