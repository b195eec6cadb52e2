"""One error path for ``miles-rollout``: expected failures print one line and exit 2.

Expected failures are the user's input and environment: a bad flag value, a missing or corrupt
checkpoint, a port in use, an engine that cannot be reached. They print ``PROG: error: ...``
naming the problem and the fix. Anything else is a bug and keeps its traceback, as does every
error under ``--debug``.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Callable

__all__ = [
    "EXIT_USAGE",
    "CommandError",
    "add_debug_flag",
    "is_listen_error",
    "listen_error",
    "run_command",
]

EXIT_USAGE = 2


class CommandError(Exception):
    """A command cannot go on; the message names the problem and the fix."""


def add_debug_flag(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--debug``: show the traceback of every error (on the top parser and each subcommand;
    a subcommand's flag does not reset the top-level one)."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show full tracebacks for errors",
    )


def is_listen_error(exc: OSError) -> bool:
    """Whether ``exc`` is how binding a socket fails (address in use or not ours)."""
    return isinstance(exc, socket.gaierror) or exc.errno in (
        errno.EADDRINUSE,
        errno.EADDRNOTAVAIL,
        errno.EAFNOSUPPORT,
    )


def listen_error(exc: OSError, host: str, port: int, what: str) -> CommandError:
    """An OSError from binding ``host:port`` as one line with the fix."""
    if exc.errno == errno.EADDRINUSE:
        return CommandError(
            f"cannot start {what}: {host}:{port} is already in use; pick another --port "
            "(0 picks a free one) or stop the process listening there"
        )
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
        return CommandError(
            f"cannot start {what}: {host} is not an address of this machine ({exc}); pass "
            "--host 127.0.0.1, or an address this machine has"
        )
    if exc.errno == errno.EACCES:
        return CommandError(
            f"cannot start {what}: no permission to listen on {host}:{port}; ports below 1024 "
            "need privileges, pick a higher --port"
        )
    return CommandError(f"cannot start {what} on {host}:{port}: {exc}")


def _expected(exc: BaseException) -> str | None:
    """The one-line message of an expected failure, or ``None`` for a bug."""
    if isinstance(exc, CommandError | ValueError | ImportError):
        return str(exc)
    name = type(exc).__name__
    if name == "SafetensorError":
        return (
            f"cannot read a safetensors file ({exc}): it is truncated or corrupt; write the "
            "checkpoint again with save_pretrained or copy it again"
        )
    if name in ("SGLangHTTPError", "StartupError"):
        return str(exc)
    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectionError):
        return f"cannot reach the engine ({exc}); start it first or fix the URL"
    if isinstance(exc, aiohttp.ClientError):
        return f"the engine request failed ({type(exc).__name__}: {exc})"
    if isinstance(exc, OSError):  # missing files, permissions, connections, full disks
        return str(exc)
    return None


def run_command(prog: str, fn: Callable[[], int], *, debug: bool) -> int:
    """Run ``fn``; print an expected failure as one line (exit 2), re-raise anything else.

    Args:
        prog: the name in the message (``miles-rollout serve``).
        fn: the command; returns its exit status.
        debug: re-raise every error (full traceback).
    """
    try:
        return fn()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = _expected(exc)
        if message is None or debug:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
