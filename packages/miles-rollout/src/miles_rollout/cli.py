"""``miles-rollout serve``: the embedded engine behind SGLang's HTTP API.

Why: drivers, routers and tests can talk to one HTTP API whether the engine is a real SGLang
server on GPUs or this CPU engine on a laptop.

Laptop:   miles-rollout serve --model-path ./tiny-qwen3 --port 30000
Cluster:  run SGLang itself (``python -m sglang.launch_server``); the client code is the same.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-rollout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a local HF checkpoint over SGLang's HTTP API")
    s.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    s.add_argument("--max-running-requests", type=int, default=64)
    s.add_argument("--context-length", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--num-threads", type=int, default=None)
    s.add_argument("--weight-version", default="0")
    s.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks in this server")
    s.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    s.add_argument("--prefix-cache-tokens", type=int, default=None)
    s.add_argument(
        "--weight-format",
        default=None,
        help="serve quantized weights: fp8_block128, mxfp8, nvfp4, mxfp4, int4_g32, int4_g128",
    )
    s.add_argument("--keep-bf16", action="append", default=[], help="pattern kept unquantized")
    s.add_argument("--keep-first-layers", type=int, default=0)
    s.add_argument("--keep-last-layers", type=int, default=0)
    from miles_rollout.fleet.cli import add_parser as add_fleet_parser

    add_fleet_parser(sub)
    from miles_rollout.models.cli import add_parser as add_convert_parser
    from miles_rollout.session.cli import add_parser as add_sessions_parser

    add_sessions_parser(sub)
    add_convert_parser(sub)
    return parser


def main(argv: list[str] | None = None, *, stop: threading.Event | None = None) -> int:
    """Run the command line; return the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        stop: serve until this is set; by default until SIGINT or SIGTERM.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "fleet":  # engine flags pass through (--sglang-*, --engine-*)
        from miles_rollout.fleet.cli import run as run_fleet

        return run_fleet(args, extra, stop=stop)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "sessions":
        from miles_rollout.session.cli import run as run_sessions

        return run_sessions(args, stop=stop)
    if args.command == "convert-gguf":
        from miles_rollout.models.cli import run as run_convert

        return run_convert(args)
    from miles_rollout.config import EngineConfig
    from miles_rollout.server import serve

    try:
        config = EngineConfig(
            model_path=args.model_path,
            dtype=args.dtype,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            seed=args.seed,
            num_threads=args.num_threads,
            weight_version=args.weight_version,
            dp_size=args.dp_size,
            enable_prefix_cache=not args.disable_radix_cache,
            prefix_cache_tokens=args.prefix_cache_tokens,
            weight_format=args.weight_format,
            keep_bf16=args.keep_bf16,
            keep_first_layers=args.keep_first_layers,
            keep_last_layers=args.keep_last_layers,
        )
        engine = config.build()
    except ValueError as exc:
        print(f"miles-rollout: error: {exc}", file=sys.stderr)
        return 2
    handle = serve(engine, host=args.host, port=args.port)
    print(f"miles-rollout serving {engine.model_path} at {handle.url}", flush=True)
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set() if stop is not None else None)
    stop.wait()
    handle.close()
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
