"""``miles-transfer delta encode|apply|verify``: disk deltas from any stack's shell.

Exit codes (as the rest of the command line): 0 success, 1 the target does not match the delta
(wrong base version, or an xor delta already applied), 2 bad input (missing or malformed
directory, corrupted or truncated delta, missing ``miles-transfer[delta]`` extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from miles_transfer.delta.apply import apply_delta, verify_delta
from miles_transfer.delta.encode import Progress, encode_delta
from miles_transfer.delta.materialize import DeltaBaseError

__all__ = ["add_delta_parser"]

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


def _progress(enabled: bool, every: float = 1.0) -> Progress | None:
    """Print ``phase: done/total GB (pct)`` to stderr at most once a second, and at the end."""
    if not enabled:
        return None
    last = [0.0]
    start = time.perf_counter()

    def report(phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] < every and done < total:
            return
        last[0] = now
        pct = 100.0 * done / max(total, 1)
        rate = done / max(now - start, 1e-9) / 1e9
        print(
            f"{phase}: {done / 1e9:.3f}/{total / 1e9:.3f} GB ({pct:.0f}%, {rate:.2f} GB/s)",
            file=sys.stderr,
            flush=True,
        )

    return report


def _guard(fn: Any, args: argparse.Namespace) -> int:
    try:
        return int(fn(args))
    except DeltaBaseError as e:
        print(f"miles-transfer delta {args.delta_command}: mismatch: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    except (ValueError, OSError, ImportError) as e:
        if getattr(args, "debug", False):  # miles-transfer --debug: the traceback
            raise
        print(f"miles-transfer delta {args.delta_command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cmd_encode(args: argparse.Namespace) -> int:
    report = encode_delta(
        args.base,
        args.new,
        args.out,
        encoding=args.encoding,
        base_version=args.base_version,
        version=args.version,
        progress=_progress(not args.quiet),
    )
    print(f"wrote {report.path}: {report.summary()}")
    return EXIT_OK


def _cmd_apply(args: argparse.Namespace) -> int:
    report = apply_delta(args.target, args.delta, progress=_progress(not args.quiet))
    print(
        f"applied {args.delta} to {args.target}: {len(report.changed)} of {report.tensors} "
        f"tensors changed, every checksum verified ({report.seconds:.2f}s)"
    )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    report = verify_delta(args.target, args.delta, progress=_progress(not args.quiet))
    print(report.message)
    return EXIT_OK


def add_delta_parser(sub: Any) -> None:
    """Register ``delta encode|apply|verify`` on the top-level subparsers."""
    p = sub.add_parser(
        "delta",
        help="encode, apply and verify disk deltas between HF safetensors checkpoints",
        description=(
            "Disk deltas: ship only the elements whose bits changed (needs "
            "pip install 'miles-transfer[delta]'). Exit 0 ok, 1 target does not match the "
            "delta, 2 bad input."
        ),
    )
    dsub = p.add_subparsers(dest="delta_command", required=True, metavar="ACTION")

    e = dsub.add_parser("encode", help="write a delta that turns --base into --new")
    e.add_argument("--base", required=True, help="checkpoint directory the engines hold now")
    e.add_argument("--new", required=True, help="checkpoint directory they should hold")
    e.add_argument("--out", required=True, help="delta directory to create (new or empty)")
    e.add_argument(
        "--encoding",
        choices=("xor", "overwrite"),
        default="xor",
        help="xor: smallest, applies once to exactly --base; overwrite: idempotent",
    )
    e.add_argument("--base-version", help="version label of --base (recorded)")
    e.add_argument("--version", help="version label of --new (recorded)")
    e.set_defaults(func=lambda a: _guard(_cmd_encode, a))

    a = dsub.add_parser("apply", help="apply a delta to a checkpoint directory in place")
    a.add_argument("--target", required=True, help="checkpoint directory to update (atomic)")
    a.add_argument("--delta", required=True, help="delta directory")
    a.set_defaults(func=lambda a: _guard(_cmd_apply, a))

    v = dsub.add_parser("verify", help="check that a delta applies (or was applied) to --target")
    v.add_argument("--target", required=True, help="checkpoint directory")
    v.add_argument("--delta", required=True, help="delta directory")
    v.set_defaults(func=lambda a: _guard(_cmd_verify, a))

    for q in (e, a, v):
        q.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
