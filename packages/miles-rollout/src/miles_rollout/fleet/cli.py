"""``miles-rollout fleet``: N engines behind sglang-router, until SIGTERM or SIGINT.

Laptop:  miles-rollout fleet --model-path ./tiny-qwen3 --engines 2 --router-port 0
GPUs:    miles-rollout fleet --backend sglang --model-path ./Qwen3-8B --engines 4 \\
             --sglang-tp-size 2 --sglang-mem-fraction-static 0.8

Engine flags pass through with a prefix: ``--engine-NAME`` to ``miles-rollout serve --NAME``,
``--sglang-NAME`` to ``sglang.launch_server --NAME``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
from typing import Any

__all__ = ["add_parser", "run"]


class _Interrupted(BaseException):
    """SIGTERM/SIGINT while the fleet starts: unwinds start(), which stops what it started."""


def add_parser(sub: Any) -> None:
    """Add the ``fleet`` subcommand to ``miles-rollout``'s subparsers."""
    f = sub.add_parser(
        "fleet",
        help="N engines behind sglang-router (session affinity by X-SMG-Routing-Key)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    f.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    f.add_argument("--engines", type=int, default=1, help="engine processes (default 1)")
    f.add_argument("--dp-size", type=int, default=1, help="DP ranks per engine (default 1)")
    f.add_argument("--router-port", type=int, default=30000, help="0 picks a free port")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--backend", choices=["embedded", "sglang", "command"], default="embedded")
    f.add_argument(
        "--command",
        dest="engine_command",  # not "command": that is the subcommand's name
        default=None,
        help="backend 'command': a shell-quoted command line with {port} (and {host}, "
        "{model_path}, {dp_size}, {index})",
    )
    f.add_argument("--sglang-python", default=None, help="the Python with SGLang installed")
    f.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="an sglang-router flag, e.g. --router-arg policy=round_robin (repeatable)",
    )
    f.add_argument("--replace-dead-engines", action="store_true")
    f.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    f.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    from miles_rollout.cli import add_auth_flags

    add_auth_flags(f)


def _router_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        lowered = value.lower()
        out[name] = (
            True if not sep else lowered == "true" if lowered in ("true", "false") else value
        )
    return out


def run(args: argparse.Namespace, extra: list[str], *, stop: threading.Event | None = None) -> int:
    """Start the fleet, print its URL, serve until ``stop`` (default: SIGINT/SIGTERM)."""
    from miles_rollout.fleet.config import FleetConfig
    from miles_rollout.fleet.sglang import parse_passthrough

    log = logging.getLogger("miles_rollout.fleet")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    from miles_rollout.auth import resolve_api_key

    prefix = "sglang-" if args.backend == "sglang" else "engine-"
    passthrough = parse_passthrough(extra, prefix)
    config = FleetConfig(
        model_path=args.model_path,
        engines=args.engines,
        dp_size=args.dp_size,
        backend=args.backend,
        router_port=args.router_port,
        host=args.host,
        engine_args=passthrough if args.backend == "embedded" else {},
        sglang_args=passthrough if args.backend == "sglang" else {},
        sglang_python=args.sglang_python,
        command=shlex.split(args.engine_command) if args.engine_command else None,
        router_args=_router_args(args.router_arg),
        replace_dead_engines=args.replace_dead_engines,
        log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout,
        api_key=resolve_api_key(args.api_key),
        insecure_no_auth=args.insecure_no_auth,
    )

    started = threading.Event()
    if stop is None:
        stop = threading.Event()

        def on_signal(*_: object) -> None:
            if not started.is_set():
                raise _Interrupted
            assert stop is not None
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    fleet = config.build()
    try:
        fleet.start()
        started.set()
        for e in fleet.engines:
            print(f"miles-rollout fleet: engine {e.index} (pid {e.pid}) at {e.url}", flush=True)
        assert fleet.router is not None
        print(f"miles-rollout fleet: router (pid {fleet.router.pid}), logs in {fleet.log_dir}")
        print(
            f"miles-rollout fleet of {len(fleet.engines)} {config.backend} engine(s), dp_size "
            f"{config.dp_size}, at {fleet.url}",
            flush=True,
        )
        while not stop.wait(0.5):
            if fleet.failed:
                return 1
        return 0
    except _Interrupted:
        return 130
    finally:
        fleet.close()
