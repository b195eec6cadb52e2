"""The ``miles-transfer`` command line: inspect and compare HF safetensors checkpoints.

Run ``miles-transfer --help``. Each subcommand is one small function registered in
``build_parser``; new ones (e.g. ``delta encode/apply/verify``) add a subparser the same way.

Exit codes: 0 success (or identical), 1 differences found, 2 bad input: one line naming the
problem and the fix (a damaged checkpoint or delta, a busy port, an unreachable engine);
``--debug`` shows the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from miles_transfer.checkpoint import iter_safetensors
from miles_transfer.delta.cli import add_delta_parser
from miles_transfer.digest import tensor_digest
from miles_transfer.version import __version__

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_DIFFERENT, EXIT_BAD_INPUT = 0, 1, 2


def _digests(path: str) -> dict[str, tuple[str, list[int], str]]:
    """``{name: (dtype, shape, digest)}`` of a checkpoint."""
    return {
        name: (str(t.dtype).removeprefix("torch."), list(t.shape), tensor_digest(t))
        for name, t in iter_safetensors(path)
    }


def _cmd_digest(args: argparse.Namespace) -> int:
    table = _digests(args.path)
    if args.json:
        print(json.dumps({n: d for n, (_, _, d) in sorted(table.items())}, indent=1))
    else:
        for name, (dtype, shape, digest) in sorted(table.items()):
            print(f"{digest}  {name}  {dtype}{shape}")
    return EXIT_OK


def _cmd_compare(args: argparse.Namespace) -> int:
    a, b = _digests(args.a), _digests(args.b)
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    changed = sorted(n for n in set(a) & set(b) if a[n] != b[n])
    for name in only_a:
        print(f"only in A: {name}")
    for name in only_b:
        print(f"only in B: {name}")
    for name in changed:
        (da, sa, _), (db, sb, _) = a[name], b[name]
        what = "bits" if (da, sa) == (db, sb) else f"{da}{sa} vs {db}{sb}"
        print(f"differs ({what}): {name}")
    if only_a or only_b or changed:
        print(
            f"{len(changed)} differ, {len(only_a)} only in A, {len(only_b)} only in B "
            f"({len(set(a) & set(b))} in both)"
        )
        return EXIT_DIFFERENT
    print(f"identical: {len(a)} tensors, bit for bit")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subcommand sets ``func`` (Namespace -> exit code)."""
    parser = argparse.ArgumentParser(
        prog="miles-transfer",
        description=(
            "Inspect and compare HF safetensors checkpoints bit for bit; encode, apply and "
            "verify disk deltas between them; receive P2P weight updates beside an engine."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("digest", help="print a digest per tensor of a checkpoint")
    p.add_argument("path", help="a .safetensors file or an HF checkpoint directory")
    p.add_argument("--json", action="store_true", help="print {name: digest} as JSON")
    p.set_defaults(func=_cmd_digest)

    p = sub.add_parser(
        "compare", help="compare two checkpoints tensor by tensor (exit 1 if any differ)"
    )
    p.add_argument("a", help="checkpoint A (file or directory)")
    p.add_argument("b", help="checkpoint B (file or directory)")
    p.set_defaults(func=_cmd_compare)

    add_delta_parser(sub)  # delta encode|apply|verify (delta/cli.py)

    p = sub.add_parser(
        "p2p-agent",
        help="receive P2P weight updates beside an SGLang-API engine and swap them in",
        description=(
            "Run on the engine's host: hosts the rendezvous store, prints 'p2p-agent ready at "
            "HOST:PORT' (give it to the trainer), receives every trainer rank's shards over "
            "TCP or shared memory, checks them bit for bit and swaps them into the engine "
            "(update_weights_from_tensor between pause and continue)."
        ),
    )
    p.add_argument("--engine-url", required=True, help="the engine, e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=0, help="store port (0 picks a free one)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    p.add_argument(
        "--api-key",
        default=None,
        help="sent to the engine, proven by every trainer rank (HMAC) and signing the "
        "rendezvous values (default: $MILES_API_KEY; none: loopback only)",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback --host without an API key (trusted networks only)",
    )
    p.set_defaults(func=_cmd_p2p_agent)
    return parser


def _cmd_p2p_agent(args: argparse.Namespace) -> int:
    from miles_transfer.auth import resolve_api_key
    from miles_transfer.p2p.engine import run_agent

    run_agent(
        args.engine_url,
        host=args.host,
        port=args.port,
        parent_pid=args.parent_pid,
        api_key=resolve_api_key(args.api_key),
        insecure_no_auth=args.insecure_no_auth,
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        print(f"miles-transfer {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Input and environment: values, files, sockets, a missing extra, a refused update.
        expected = isinstance(e, ValueError | OSError | ImportError) or any(
            c.__name__ in ("ReceiverError", "TransportError", "SafetensorError")
            for c in type(e).__mro__
        )
        if args.debug or not expected:
            raise
        print(f"miles-transfer {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
