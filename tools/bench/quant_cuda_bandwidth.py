"""Quantizer bandwidth on a CUDA GPU: miles-quant's CUDA kernels vs a device copy and torch casts.

Why: the CPU bench (quant_bandwidth.py) cannot see the CUDA kernels (native/quant/cuda). This
one times them on the same shapes and formats, in bf16, against peers in the same run on the
same buffers:

- a device-to-device copy of the input (``dst.copy_(x)``, same dtype): the memory-bound limit;
- torch's plain float8 casts (``dst.copy_(x)`` into a float8 buffer; no scale computed);
- miles-quant's PyTorch reference run on the GPU (``backend="torch"``: the same bits, eager ops);
- torchao's eager ``to_mx`` / ``nvfp4_quantize`` on the GPU when torchao is importable.

GB/s counts bytes read plus bytes written, as the CPU bench does. Each method is timed with
CUDA events over ``--iters`` back-to-back calls, after a warm-up; methods run interleaved and
the table shows the best of ``--repeat`` such rounds (``--json`` keeps the medians too).

Needs a build with the CUDA kernels (tools/gpu_checks/quant_cuda_check.sh builds one):
    python tools/bench/quant_cuda_bandwidth.py --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import warnings
from collections.abc import Callable

import torch

# The CPU bench beside this file (its directory is sys.path[0] when run as a script): the same
# shapes, formats, timed-method record, byte count and torchao peers.
from quant_bandwidth import FORMATS, SHAPES, Method, _nbytes, _torchao, native_call

import miles_quant as mq


def methods_for(x: torch.Tensor, label: str, fmt: str, gran: str, rule: str | None) -> list[Method]:
    """The timed methods of one bench row on x (a "static" label: NVFP4 with its global scale
    given, for miles-quant, its reference and torchao alike)."""
    q, kw = native_call(x, label, fmt, gran, rule, backend="native")
    static = "global_scale" in kw
    quantize = functools.partial(mq.quantize, x, fmt, **kw)
    moved = x.nbytes + _nbytes(q)
    ms = [Method("native", 1, functools.partial(quantize, out=q), moved)]
    ms.append(Method("reference", 1, functools.partial(quantize, backend="torch"), moved))
    el = mq.FORMATS[fmt].element
    if el is not None and el.torch_dtype is not None and fmt != "mxfp4":
        dst = torch.empty(x.shape, dtype=el.torch_dtype, device=x.device)
        ms.append(Method("torch cast", 1, functools.partial(dst.copy_, x), x.nbytes + dst.nbytes))
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
        ms.append(Method("torchao eager", 1, fn, moved))
    return ms


def _time(m: Method, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        m.fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def run_shape(shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    formats = [f for f in FORMATS if not args.formats or f[1] in args.formats]
    per_format = {label: methods_for(x, label, f, gr, r) for label, f, gr, r in formats}
    dst = torch.empty_like(x)
    copy = Method("copy", 1, functools.partial(dst.copy_, x), 2 * x.nbytes)
    everything = [copy] + [m for ms in per_format.values() for m in ms]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in everything:
            for _ in range(3):
                m.fn()
        torch.cuda.synchronize()
        for _ in range(args.repeat):
            for m in everything:
                m.times.append(_time(m, args.iters))
    out: dict[str, object] = {"shape": list(shape)}
    for stat in ("best", "median"):
        rows = {label: {m.name: m.gbps(stat) for m in ms} for label, ms in per_format.items()}
        out[stat] = {"copy": copy.gbps(stat), "formats": rows}
    return out


def print_table(name: str, res: dict[str, object], stat: str) -> None:
    r = res[stat]
    assert isinstance(r, dict)
    copy = r["copy"]
    cols = ["native", "reference", "torch cast", "torchao eager"]
    print(f"\n### {name} bf16 ({stat} of the rounds)   device copy: {copy:.0f} GB/s")
    head = [f"{c} GB/s" for c in cols] + ["native/copy", "native/reference", "native/torchao"]
    print("| format | " + " | ".join(head) + " |")
    print("| --- " * (len(head) + 1) + "|")
    for label, row in r["formats"].items():
        cells = [f"{row[c]:.0f}" if c in row else "-" for c in cols]
        n = row["native"]
        cells.append(f"{n / copy:.2f}")
        cells.append(f"{n / row['reference']:.0f}x")
        cells.append(f"{n / row['torchao eager']:.1f}x" if "torchao eager" in row else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--formats", nargs="*", choices=sorted({f[1] for f in FORMATS}))
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--iters", type=int, default=20, help="calls per timed round (default 20)")
    p.add_argument("--stat", choices=["best", "median"], default="best")
    p.add_argument("--json", help="write every figure (best and median) here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quant_cuda_bandwidth: needs a CUDA device")
    from miles_quant import _native

    if not _native.cuda_available():
        raise SystemExit(
            f"quant_cuda_bandwidth: no CUDA kernels in this build ({_native.cuda_error()})"
        )
    print(
        f"# miles-quant CUDA bandwidth, torch {torch.__version__}, {torch.cuda.get_device_name(0)}"
    )
    results = {}
    for name in args.shapes:
        results[name] = run_shape(SHAPES[name], args)
        print_table(name, results[name], args.stat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
