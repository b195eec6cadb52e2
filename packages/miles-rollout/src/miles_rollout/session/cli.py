"""``miles-rollout sessions``: the TITO session server in front of an engine.

Why: agent frameworks speak OpenAI chat; RL needs the exact ids the policy generated. Point the
agent at ``http://HOST:PORT/sessions/<id>/v1`` after ``POST /sessions``.

Laptop:   miles-rollout serve --model-path DIR --port 30000 &
          miles-rollout sessions --engine-url http://127.0.0.1:30000 --model-path DIR --port 8000
Cluster:  --engine-url of an SGLang server or an sglang-router (sessions stick by routing key).

``--api-key`` (default ``$MILES_API_KEY``) protects this server and is sent to the engine unless
``--engine-api-key`` names another key.
"""

from __future__ import annotations

import argparse
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
    from miles_rollout.cli import add_auth_flags

    add_auth_flags(p)
    p.add_argument("--engine-api-key", default=None, help="the engine's key (default: --api-key)")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="413 above it")
    p.add_argument(
        "--max-pending-turns",
        type=int,
        default=1024,
        help="chat turns in flight at most; more get 503 + Retry-After",
    )


def run(args: argparse.Namespace, *, stop: threading.Event | None = None) -> int:
    """Serve until ``stop`` is set (default: SIGINT / SIGTERM); return the exit status.

    Raises:
        ValueError, OSError: bad flags, no tokenizer, a busy port (``miles-rollout`` prints
            them as one line).
    """
    from miles_rollout._cli_errors import is_listen_error, listen_error
    from miles_rollout.auth import resolve_api_key
    from miles_rollout.cli import wait_for_stop
    from miles_rollout.session.server import serve_sessions

    api_key = resolve_api_key(args.api_key)
    engine_key = resolve_api_key(args.engine_api_key) if args.engine_api_key else api_key
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
            api_key=api_key,
            engine_api_key=engine_key,
            insecure_no_auth=args.insecure_no_auth,
            max_request_mb=args.max_request_mb,
            max_pending_turns=args.max_pending_turns,
        )
    except OSError as exc:
        if not is_listen_error(exc):  # e.g. tokenizer files that cannot be read
            raise
        raise listen_error(exc, args.host, args.port, "the session server") from exc
    print(f"miles-rollout sessions for {args.engine_url} at {handle.url}", flush=True)
    try:
        wait_for_stop(stop)
    finally:
        handle.close()
    return 0
