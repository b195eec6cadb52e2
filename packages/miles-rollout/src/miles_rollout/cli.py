"""``miles-rollout serve``: the embedded engine behind SGLang's HTTP API.

Why: drivers, routers and tests can talk to one HTTP API whether the engine is a real SGLang
server on GPUs or this CPU engine on a laptop.

Laptop:   miles-rollout serve --model-path ./tiny-qwen3 --port 30000
Cluster:  MILES_API_KEY=... miles-rollout serve --model-path DIR --host 0.0.0.0 --port 30000
          or SGLang itself (``python -m sglang.launch_server --api-key ...``); the client code
          is the same.

Every subcommand takes ``--api-key`` (default ``$MILES_API_KEY``): clients must send
``Authorization: Bearer <key>``. A non-loopback ``--host`` without a key refuses to start unless
``--insecure-no-auth``. Mistakes (a bad flag, a corrupt checkpoint, a busy port) print one line
and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading

from miles_rollout._cli_errors import (
    add_debug_flag,
    listen_error,
    run_command,
)

__all__ = ["add_auth_flags", "main"]


def add_auth_flags(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` and ``--insecure-no-auth`` (and ``--debug``) for a serving subcommand."""
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every request but GET /health "
        "(default: $MILES_API_KEY; none: no auth, loopback only)",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback --host without an API key (trusted networks only)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-rollout", description=__doc__.splitlines()[0])
    add_debug_flag(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a local HF checkpoint over SGLang's HTTP API")
    add_auth_flags(s)
    add_debug_flag(s)
    s.add_argument(
        "--max-request-mb",
        type=float,
        default=64.0,
        help="largest request body accepted (413 above it)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="generate requests waiting beyond the running batch; more get 503 + Retry-After",
    )
    s.add_argument(
        "--allow-pickle-weights",
        action="store_true",
        help="also accept SGLang's pickled update_weights_from_tensor payloads (trusted senders "
        "only); the default takes only miles_safetensors",
    )
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
    for name, sp in sub.choices.items():
        if name != "serve":
            add_debug_flag(sp)
    return parser


def main(argv: list[str] | None = None, *, stop: threading.Event | None = None) -> int:
    """Run the command line; return the exit status (2: a mistake, printed as one line).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        stop: serve until this is set; by default until SIGINT or SIGTERM.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "fleet" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return run_command(
        f"miles-rollout {args.command}",
        lambda: _dispatch(args, extra, stop),
        debug=bool(getattr(args, "debug", False)),
    )


def _dispatch(args: argparse.Namespace, extra: list[str], stop: threading.Event | None) -> int:
    if args.command == "fleet":  # engine flags pass through (--sglang-*, --engine-*)
        from miles_rollout.fleet.cli import run as run_fleet

        return run_fleet(args, extra, stop=stop)
    if args.command == "sessions":
        from miles_rollout.session.cli import run as run_sessions

        return run_sessions(args, stop=stop)
    if args.command == "convert-gguf":
        from miles_rollout.models.cli import run as run_convert

        return run_convert(args)
    return _serve(args, stop)


def wait_for_stop(stop: threading.Event | None) -> None:
    """Block until ``stop`` is set, or (``None``) until SIGINT or SIGTERM."""
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set() if stop is not None else None)
    stop.wait()


def _serve(args: argparse.Namespace, stop: threading.Event | None) -> int:
    from miles_rollout.auth import check_bind, resolve_api_key
    from miles_rollout.config import EngineConfig
    from miles_rollout.server import serve

    api_key = resolve_api_key(args.api_key)
    # Before the model loads: a refused address should not cost the load.
    check_bind(
        args.host, api_key, insecure_no_auth=args.insecure_no_auth, what="miles-rollout serve"
    )
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise listen_error(exc, args.host, args.port, "the engine server") from exc
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
    except BaseException:
        sock.close()
        raise
    try:
        handle = serve(
            engine,
            api_key=api_key,
            insecure_no_auth=args.insecure_no_auth,
            max_request_mb=args.max_request_mb,
            max_queued_requests=args.max_queued_requests,
            sock=sock,
            allow_pickle_weights=args.allow_pickle_weights,
        )
    except BaseException:
        sock.close()
        engine.shutdown()
        raise
    print(f"miles-rollout serving {engine.model_path} at {handle.url}", flush=True)
    try:
        wait_for_stop(stop)
    finally:
        handle.close()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
