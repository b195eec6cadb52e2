"""What a small miles-quant call costs: online activation quantization runs once per token (or
per small batch of tokens) per layer, where the work is a few microseconds and the cost of the
call itself decides the speed.

For each format on bf16 inputs of [T, 7168] (T = 1, 16, 128 tokens) it times, best of
`--repeat` interleaved rounds of `--calls` calls each, on one thread:

- ``quantize(x, fmt)`` (allocates its result) and ``quantize(x, fmt, out=q)`` (reuses q);
- the peers on the same input: torch's cast into a preallocated float8 buffer
  (``dst.copy_(x)``: no scale at all) and ``x.to(float8)`` (allocates), and torchao's eager
  ``to_mx`` / ``nvfp4_quantize`` where it has the format.

Laptop:   python tools/bench/quant_call_overhead.py              # ~1 min on 2 cores
          python tools/bench/quant_call_overhead.py --tokens 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable

import torch
from quant_bandwidth import _torchao as torchao_quantizers

import miles_quant as mq

FORMATS = [("fp8_e4m3", "1x128"), ("fp8_e4m3", "tensor"), ("mxfp8_e4m3", "1x32"),
           ("mxfp4", "1x32"), ("nvfp4", "1x16"), ("int4_g128", "1x128")]  # fmt: skip


def _torchao(fmt: str, x: torch.Tensor) -> Callable[[], object] | None:
    """torchao's eager quantizer of `fmt` on x (quant_bandwidth's peers), if it has one."""
    ao = torchao_quantizers()
    if ao is None:
        return None
    mx, nvfp4, _ = ao
    if fmt == "mxfp8_e4m3":
        return lambda: mx(x, torch.float8_e4m3fn, "floor")
    if fmt == "mxfp4":
        return lambda: mx(x, torch.float4_e2m1fn_x2, "floor")
    if fmt == "nvfp4":
        return lambda: nvfp4(x)
    return None


def per_call_us(fns: dict[str, Callable[[], object]], calls: int, repeat: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in fns.values():
            fn()
        for _ in range(repeat):  # interleaved: each round times every method
            for k, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[k] = min(best[k], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=300, help="calls per timed round")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (best is shown)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(
        f"# miles-quant per-call cost, torch {torch.__version__}, one thread, "
        f"native: {mq.native_available()}"
    )
    results = []
    for t in args.tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
        f8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        peers: dict[str, Callable[[], object]] = {
            "torch cast into fp8 buffer": lambda f8=f8, x=x: f8.copy_(x),
            "x.to(float8)": lambda x=x: x.to(torch.float8_e4m3fn),
        }
        peer_us = per_call_us(peers, args.calls, args.repeat)
        print(
            f"\n### [{t}, {args.hidden}] bf16   "
            + ", ".join(f"{k} {v:.1f} us" for k, v in peer_us.items())
        )
        print("| format | quantize us | quantize(out=q) us | torchao eager us | torchao / out=q |")
        print("| --- | --- | --- | --- | --- |")
        for fmt, gran in FORMATS:
            q = mq.quantize(x, fmt, granularity=gran)
            fns: dict[str, Callable[[], object]] = {
                "new": lambda x=x, f=fmt, g=gran: mq.quantize(x, f, granularity=g),
                "out": lambda x=x, f=fmt, g=gran, q=q: mq.quantize(x, f, granularity=g, out=q),
            }
            ao = _torchao(fmt, x)
            if ao is not None:
                fns["torchao"] = ao
            us = per_call_us(fns, args.calls, args.repeat)
            ratio = f"{us['torchao'] / us['out']:.0f}x" if "torchao" in us else "-"
            ao_us = f"{us['torchao']:.1f}" if "torchao" in us else "-"
            print(f"| {fmt} {gran} | {us['new']:.1f} | {us['out']:.1f} | {ao_us} | {ratio} |")
            results.append({"tokens": t, "format": fmt, "granularity": gran, **us, **peer_us})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
