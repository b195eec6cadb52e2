"""Native quantizer cost per element, in cache and from DRAM, with the per-call overhead removed.

    python tools/bench/quant_per_element.py

For each format, one thread: the time of a 16x128 call (the fixed per-call overhead, mostly
Python), then ns per element net of it for a 256x1024 input (in L2), 1024x1024 and 4096x4096. The
same figure in L2 and from DRAM means the kernel is compute-bound (docs/benchmarks.md, "AMD
EPYC (Zen 4) host"). Best of 7 repeats; `out=` reuses the output buffers.
"""

from __future__ import annotations

import time

import torch

import miles_quant as mq

CASES = [
    ("fp8_e4m3", "1x128"),
    ("fp8_block128", None),
    ("mxfp8_e4m3", None),
    ("mxfp4", None),
    ("nvfp4", None),
    ("int4_g128", None),
]


def seconds_per_call(x: torch.Tensor, fmt: str, gran: str | None, n: int) -> float:
    q = mq.quantize(x, fmt, granularity=gran, backend="native", threads=1)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            mq.quantize(x, fmt, granularity=gran, backend="native", threads=1, out=q)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for fmt, gran in CASES:
        small = seconds_per_call(torch.randn(16, 128, generator=g).bfloat16(), fmt, gran, 2000)
        cells = []
        for shape in [(256, 1024), (1024, 1024), (4096, 4096)]:
            x = torch.randn(*shape, generator=g).bfloat16()
            t = seconds_per_call(x, fmt, gran, max(5, int(5e7 // x.numel())))
            cells.append(f"{shape[0]}x{shape[1]} {(t - small) / x.numel() * 1e9:.3f}")
        print(f"{fmt:13s} per call {small * 1e6:5.1f} us | ns/element net: " + ", ".join(cells))


if __name__ == "__main__":
    main()
