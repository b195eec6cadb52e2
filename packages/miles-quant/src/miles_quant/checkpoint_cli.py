"""Command line for `miles_quant.checkpoint`: convert an HF checkpoint to an engine layout.

Installed as ``miles-quant-checkpoint``; ``tools/quantize_checkpoint.py`` runs the same
``main``. ``--help`` lists the flags; the README's "Checkpoints" section has examples.

A mistake (a bad flag, a missing, damaged or half-written checkpoint, a full disk) prints one line
``miles-quant-checkpoint: error: ...`` naming the problem and the fix and exits 2; ``--debug``
shows the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_quant.calibrate import calibrate_checkpoint, read_prompts
from miles_quant.checkpoint import LAYOUTS, dequantize_checkpoint, export_checkpoint, plan_export

__all__ = ["build_parser", "main"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="miles-quant-checkpoint",
        description=(
            "Quantize an HF safetensors checkpoint into the layout an engine loads "
            "(fp8_block128: DeepSeek FP8; nvfp4: ModelOpt; mxfp4: gpt-oss; int4_g32 / "
            "int4_g128: compressed-tensors W4A16), or --dequantize one back to a plain "
            "checkpoint. Embeddings, lm_head, norms, routers and biases are always kept."
        ),
    )
    p.add_argument("src", type=Path, help="source model directory (config.json + safetensors)")
    p.add_argument("dst", type=Path, help="output directory (created atomically)")
    p.add_argument("-f", "--format", choices=sorted(LAYOUTS), help="quantization format")
    p.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep matching tensors in source precision: a glob on tensor or module names "
        "('*.self_attn.*', 'model.layers.0') or 're:' + a regex; repeatable",
    )
    p.add_argument("--keep-first-layers", type=int, default=0, metavar="N")
    p.add_argument("--keep-last-layers", type=int, default=0, metavar="N")
    p.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="PATTERN",
        help="quantize only matching tensors (e.g. '*.experts.*' for W4A16 experts); repeatable",
    )
    p.add_argument("--scale-rule", choices=("floor", "rceil", "even"), help="mxfp4 E8M0 rule")
    p.add_argument(
        "--input-amax",
        type=Path,
        metavar="JSON",
        help="nvfp4: a JSON object {module name: activation amax} from calibration "
        "(or use --calib-data)",
    )
    p.add_argument(
        "--calib-data",
        type=Path,
        metavar="JSONL",
        help="nvfp4: calibrate input_scale on these prompts (one per line: a JSON string or "
        "an object with 'text', 'prompt' or 'messages'), running src with its tokenizer",
    )
    p.add_argument(
        "--calib-samples",
        type=int,
        default=128,
        metavar="N",
        help="--calib-data: use the first N prompts (default 128)",
    )
    p.add_argument(
        "--calib-max-length",
        type=int,
        default=2048,
        metavar="L",
        help="--calib-data: tokens per prompt at most (default 2048)",
    )
    p.add_argument(
        "--calib-out",
        type=Path,
        metavar="JSON",
        help="--calib-data: also save the measured amax (reusable as --input-amax)",
    )
    p.add_argument("--max-shard-size", type=_size, default="5GB", help="e.g. 2GB, 500MiB")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dst")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=_positive_int, help="CPU threads, >= 1 (default: torch's)")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="write a plain HF checkpoint from the quantized src instead",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="--dequantize output dtype")
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return p


def _progress(enabled: bool, total: int) -> tuple[Callable[[int, int, str], None], Any]:
    if not enabled:
        return (lambda done, n, name: None), None
    try:
        from tqdm import tqdm  # pants: no-infer-dep (optional: plain progress lines without it)
    except ImportError:
        state = {"next": 0.0}

        def plain(done: int, n: int, name: str) -> None:
            if n > 0 and done / n >= state["next"]:
                print(f"[{done}/{n}] {name}", file=sys.stderr)
                state["next"] += 0.1

        return plain, None
    bar = tqdm(total=total if total > 0 else None, unit="tensor", file=sys.stderr)

    def update(done: int, n: int, name: str) -> None:
        bar.set_postfix_str(name[-48:], refresh=False)
        bar.update(done - bar.n)

    return update, bar


def _input_amax(args: argparse.Namespace) -> dict[str, float] | None:
    """The activation amax per module: from --input-amax, or measured with --calib-data."""
    if args.input_amax is not None:
        try:
            amax = json.loads(args.input_amax.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{args.input_amax}: not valid JSON ({e}); expected an object {{module: amax}} "
                "as --calib-out writes it"
            ) from None
        if not isinstance(amax, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in amax.values()
        ):
            raise ValueError(
                f"{args.input_amax}: expected a JSON object {{module: amax}} with numbers as "
                "values (as --calib-out writes it)"
            )
        return {str(k): float(v) for k, v in amax.items()}
    if args.calib_data is None:
        return None
    prompts = read_prompts(args.calib_data, limit=args.calib_samples)
    start = time.perf_counter()
    cal = calibrate_checkpoint(args.src, prompts, max_length=args.calib_max_length)
    print(
        f"calibrated {len(cal.amax)} Linear modules on {cal.batches} prompts in "
        f"{time.perf_counter() - start:.1f} s"
        + (f"; {len(cal.unused)} received no input" if cal.unused else "")
    )
    if args.calib_out is not None:
        cal.save(args.calib_out)
    return cal.amax


def _run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    show = not args.no_progress
    if args.dequantize and args.format is not None:
        raise ValueError("--dequantize reads the format from src; drop -f/--format")
    if args.dtype is not None and not args.dequantize:
        raise ValueError("--dtype sets the --dequantize output dtype; pass --dequantize too")
    if args.calib_out is not None and args.calib_data is None:
        raise ValueError("--calib-out saves what --calib-data measures; pass --calib-data too")
    if args.dequantize:
        dtype = _DTYPES[args.dtype] if args.dtype else None
        update, bar = _progress(show, -1)
        try:
            out = dequantize_checkpoint(
                args.src,
                args.dst,
                dtype=dtype,
                max_shard_bytes=args.max_shard_size,
                overwrite=args.overwrite,
                progress=update,
            )
        finally:
            if bar is not None:
                bar.close()
        print(f"wrote {out}")
        return 0
    if args.format is None:
        raise ValueError("choose a format with -f/--format (or pass --dequantize)")
    if args.input_amax is not None and args.calib_data is not None:
        raise ValueError("pass either --input-amax or --calib-data, not both")
    if args.calib_data is not None and args.format != "nvfp4":
        raise ValueError(f"--calib-data calibrates the nvfp4 input_scale, not {args.format}")
    options: dict[str, Any] = {
        "keep_bf16": args.keep,
        "keep_first_layers": args.keep_first_layers,
        "keep_last_layers": args.keep_last_layers,
        "only": args.only,
    }
    plan = plan_export(args.src, args.format, **options)
    print(
        f"{args.format} ({plan.layout.description}): {len(plan.quantized)} tensors quantized, "
        f"{len(plan.kept)} kept"
    )
    if args.dry_run:
        for name in plan.quantized:
            print(f"  quantize  {name}")
        for name, why in plan.kept.items():
            print(f"  keep      {name}  ({why})")
        for group in plan.fused:
            print(f"  fused     {' + '.join(group)}")
        return 0
    input_amax = _input_amax(args)
    update, bar = _progress(show, len(plan.quantized) + len(plan.kept))
    start = time.perf_counter()
    try:
        done = export_checkpoint(
            args.src,
            args.dst,
            args.format,
            **options,
            scale_rule=args.scale_rule,
            input_amax=input_amax,
            max_shard_bytes=args.max_shard_size,
            overwrite=args.overwrite,
            progress=update,
        )
    finally:
        if bar is not None:
            bar.close()
    if input_amax is not None:
        default = sorted(m for m in done.input_scales if m not in input_amax)
        print(
            f"input_scale: calibrated for {len(done.input_scales) - len(default)} modules, "
            f"1.0 for {len(default)}" + (f" (e.g. {default[0]})" if default else "")
        )
    size = sum(f.stat().st_size for f in Path(args.dst).glob("*.safetensors"))
    print(f"wrote {args.dst} ({size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s")
    return 0


def _expected(e: BaseException) -> bool:
    """Input and environment errors (bad values, files, disks); anything else is a bug."""
    if isinstance(e, ValueError | ImportError | OSError):
        return True
    return type(e).__name__ == "SafetensorError"  # a damaged file the reader did not name


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on a usage or input error)."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("miles-quant-checkpoint: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not _expected(e):
            raise
        print(f"miles-quant-checkpoint: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
