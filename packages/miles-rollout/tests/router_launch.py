"""Start the real sglang-router for a test without a pick-then-close race.

The router binds the port numbers it is given (it cannot bind port 0 and report it), so a
number picked here can be taken by another process before the router binds it. As the fleet
does (``Fleet._start_router``), a router that exits with "Address already in use" is started
again on new numbers; any other early exit fails the test with the router's log.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

__all__ = ["launch_router", "stop_router"]

ATTEMPTS = 5


def _port_number() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_router(
    binary: str,
    args: Sequence[str],
    ready: Callable[[str], bool],
    *,
    deadline_s: float = 60.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """``sglang-router launch ARGS --host 127.0.0.1 --port P --prometheus-port Q`` on loopback.

    Args:
        binary: the sglang-router executable.
        args: the launch arguments other than host and ports.
        ready: ``ready(url)`` is true once the router serves what the test needs.
        deadline_s: how long one start may take to become ready.

    Returns:
        The running process (the caller stops it) and its base URL.
    """
    for attempt in range(ATTEMPTS):
        port, metrics = _port_number(), _port_number()
        cmd = [binary, "launch", *args, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
        with tempfile.TemporaryFile() as log:  # the router keeps its own handle to it
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + deadline_s
            while proc.poll() is None and not ready(url):
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise AssertionError(f"the router did not become ready in {deadline_s} s")
                time.sleep(0.3)
            if proc.poll() is None:
                return proc, url
            log.seek(0)
            text = log.read().decode(errors="replace")
        if "Address already in use" not in text or attempt == ATTEMPTS - 1:
            raise AssertionError(f"the router exited ({proc.returncode}): {text[-2000:]}")
    raise AssertionError("unreachable")  # the loop returns or raises


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the router and wait for it."""
    if proc.poll() is None:
        proc.terminate()
    proc.wait(timeout=30)
