"""Starting one engine process and waiting until it serves.

Three backends build the command line (:func:`engine_command`); the wait is the same for all:
the process must stay up, its URL is known (the embedded engine binds port 0 and prints
``... at http://HOST:PORT``; the others get a free port), and ``GET /health`` must answer 200
(connection refused and 503 mean "still starting", as SGLang answers while it loads).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_rollout.fleet.config import FleetConfig
from miles_rollout.fleet.launcher import FleetProcess
from miles_rollout.fleet.sglang import cli_flags, sglang_argv

__all__ = [
    "EngineCommand",
    "StartupError",
    "engine_command",
    "engine_env",
    "free_port",
    "wait_for",
    "wait_healthy",
]

_URL_LINE = re.compile(rb" at (http://[^\s]+)")


class StartupError(RuntimeError):
    """A fleet process did not come up; the message holds the tail of its log."""


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """How to start one engine: ``argv``, and ``port`` (0: it announces its URL in its log)."""

    argv: list[str]
    port: int


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for programs that cannot bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_command(cfg: FleetConfig, index: int) -> EngineCommand:
    """The command line of engine ``index`` for ``cfg.backend`` (the embedded backend's API
    key travels in the environment: :func:`engine_env`)."""
    if cfg.backend == "embedded":
        argv = [sys.executable, "-m", "miles_rollout.cli", "serve"]
        argv += ["--model-path", cfg.model_path, "--host", cfg.host, "--port", "0"]
        if cfg.insecure_no_auth:
            argv.append("--insecure-no-auth")
        if cfg.dp_size > 1:
            argv += ["--dp-size", str(cfg.dp_size)]
        args: dict[str, Any] = dict(cfg.engine_args)
        args["seed"] = int(args.get("seed", 0)) + index  # engines draw different streams
        if cfg.weight_format is not None:
            args.setdefault("weight_format", cfg.weight_format)
        return EngineCommand(argv + cli_flags(args), 0)
    port = free_port(cfg.host)
    if cfg.backend == "sglang":
        sglang_args = dict(cfg.sglang_args)
        if cfg.api_key is not None:
            sglang_args["api_key"] = cfg.api_key
        argv = sglang_argv(
            index=index,
            model_path=cfg.model_path,
            host=cfg.host,
            port=port,
            dp_size=cfg.dp_size,
            sglang_args=sglang_args,
            python=cfg.sglang_python,
            weight_format=cfg.weight_format,
        )
        return EngineCommand(argv, port)
    assert cfg.command is not None
    values = {
        "port": port,
        "host": cfg.host,
        "model_path": cfg.model_path,
        "dp_size": cfg.dp_size,
        "index": index,
    }
    return EngineCommand([part.format(**values) for part in cfg.command], port)


def engine_env(cfg: FleetConfig) -> dict[str, str]:
    """The engines' environment: this process's plus ``cfg.engine_env``, with
    ``MILES_API_KEY`` set to the fleet's key (what ``miles-rollout serve`` and a ``command``
    engine read), or removed when the fleet has none (an inherited key would lock the
    router out)."""
    from miles_rollout.auth import API_KEY_ENV

    env = {**os.environ, **cfg.engine_env}
    env.pop(API_KEY_ENV, None)
    if cfg.api_key is not None:
        env[API_KEY_ENV] = cfg.api_key
    return env


def wait_for(
    check: Callable[[], bool],
    *,
    child: FleetProcess,
    what: str,
    deadline: float,
    interval_s: float = 0.1,
    cancel: threading.Event | None = None,
) -> None:
    """Poll ``check()`` until it is true; fail at once if ``child`` exits or ``cancel`` is
    set, or at ``deadline``.

    Raises:
        StartupError: the process exited, the wait was cancelled, or the deadline passed
            (with the tail of the process's log).
    """
    while True:
        if cancel is not None and cancel.is_set():
            raise StartupError(f"cancelled while waiting for {child.name} to get to {what}")
        status = child.poll()
        if status is not None:
            raise StartupError(
                f"{child.name} exited with status {status} before {what}; "
                f"last lines of {child.log_path}:\n{child.log_tail()}"
            )
        if check():
            return
        if time.monotonic() > deadline:
            raise StartupError(
                f"{child.name} (pid {child.pid}) did not get to {what} in time; "
                f"last lines of {child.log_path}:\n{child.log_tail()}"
            )
        time.sleep(interval_s)


def announced_url(child: FleetProcess) -> str | None:
    """The ``http://...`` URL the process printed after `` at `` in its log, if any yet."""
    match = _URL_LINE.search(child.read_log())  # the log may be on another machine
    return match.group(1).decode() if match else None


def health_ok(url: str, timeout_s: float = 5.0) -> bool:
    """``GET {url}/health`` answered 200 (refused, 5xx and timeouts: not yet)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(
    child: FleetProcess,
    command: EngineCommand,
    host: str,
    deadline: float,
    cancel: threading.Event | None = None,
) -> str:
    """Wait until the engine answers ``/health`` with 200; return its base URL.

    Raises:
        StartupError: it exited, was not healthy by ``deadline``, or ``cancel`` was set.
    """
    url = f"http://{host}:{command.port}" if command.port else None
    if url is None:
        found: list[str] = []

        def announced() -> bool:
            u = announced_url(child)
            if u is not None:
                found.append(u)
            return u is not None

        wait_for(announced, child=child, what="printing its URL", deadline=deadline, cancel=cancel)
        url = found[0]
    base = url
    wait_for(
        lambda: health_ok(base),
        child=child,
        what=f"a healthy {base}/health",
        deadline=deadline,
        cancel=cancel,
    )
    return base
