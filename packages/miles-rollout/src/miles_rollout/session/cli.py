"""``miles-rollout sessions``: the TITO session server in front of an engine.

Why: agent frameworks speak OpenAI chat; RL needs the exact ids the policy generated. Point the
agent at ``http://HOST:PORT/sessions/<id>/v1`` after ``POST /sessions``.

Laptop:   miles-rollout serve --model-path DIR --port 30000 &
          miles-rollout sessions --engine-url http://127.0.0.1:30000 --model-path DIR --port 8000
Cluster:  --engine-url of an SGLang server or an sglang-router (sessions stick by routing key).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add the ``sessions`` subcommand to an argparse subparsers object."""
    p = sub.add_parser("sessions", help="serve TITO chat sessions in front of an engine")
    p.add_argument("--engine-url", required=True, help="SGLang-API engine or router base URL")
    p.add_argument("--model-path", required=True, help="directory of the tokenizer and template")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument(
        "--template-family", default=None, help="qwen3, chatml, llama3 or mistral (default: detect)"
    )
    p.add_argument("--engine-timeout", type=float, default=600.0, help="seconds per engine call")
    p.add_argument(
        "--context-length", type=int, default=None, help="default: ask the engine at first use"
    )
    p.add_argument(
        "--return-routed-experts",
        action="store_true",
        help="MoE engines (R3): export each sample's routed experts",
    )


def run(args: argparse.Namespace, *, stop: threading.Event | None = None) -> int:
    """Serve until ``stop`` is set (default: SIGINT / SIGTERM); return the exit status."""
    from miles_rollout.session.server import serve_sessions

    try:
        handle = serve_sessions(
            args.engine_url,
            model_path=args.model_path,
            host=args.host,
            port=args.port,
            template_family=args.template_family,
            engine_timeout_s=args.engine_timeout,
            context_length=args.context_length,
            return_routed_experts=args.return_routed_experts,
        )
    except (ValueError, OSError) as exc:
        print(f"miles-rollout: error: {exc}", file=sys.stderr)
        return 2
    print(f"miles-rollout sessions for {args.engine_url} at {handle.url}", flush=True)
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set() if stop is not None else None)
    stop.wait()
    handle.close()
    return 0
