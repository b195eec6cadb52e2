"""Child processes that cannot outlive the fleet.

Each child runs in its own session (so one signal reaches it and everything it forks, such as
SGLang's scheduler processes) and, on Linux, with ``PR_SET_PDEATHSIG`` = SIGKILL, so it dies
with the fleet even when the fleet itself is killed with SIGKILL and has no chance to clean up.

The kernel sends the death signal when the *thread* that forked the child exits, not the
process. :class:`Spawner` therefore forks every child from one thread that lives exactly as long
as the fleet; a child forked from a short-lived executor thread would die with that thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["ChildProcess", "Spawner", "log_tail", "wait_gone"]

_PR_SET_PDEATHSIG = 1


def _pdeathsig_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that sets PDEATHSIG = SIGKILL, or ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl  # resolved here: the forked child only calls it, then execs

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return hook


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ChildProcess:
    """One child process (its own session and process group), its log file and its name."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit status once the process has exited (negative: killed by that signal)."""
        return self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def read_log(self) -> bytes:
        """The whole log so far (b'' before it exists)."""
        try:
            return self.log_path.read_bytes()
        except OSError:
            return b""

    def stop(self, timeout_s: float) -> int:
        """SIGTERM the whole process group, SIGKILL it after ``timeout_s``; reap; exit status."""
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        # The leader may be gone while processes it forked still run: kill the rest too.
        self._signal_group(signal.SIGKILL)
        return self.popen.wait()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


class Spawner:
    """Forks children from one dedicated thread (see the module docstring); ``close()`` ends it."""

    def __init__(self) -> None:
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-spawn")
        self._hook = _pdeathsig_hook()

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> ChildProcess:
        """Start ``argv`` with stdout and stderr written to ``log_path`` (truncated first).

        Raises:
            FileNotFoundError: the executable does not exist.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)

        def start() -> subprocess.Popen[bytes]:
            with open(log_path, "wb") as log:
                log.write(f"$ {' '.join(argv)}\n".encode())
                log.flush()
                return subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=None if env is None else dict(env),
                    start_new_session=True,
                    preexec_fn=self._hook,  # only prctl, then exec
                )

        return ChildProcess(name, self._thread.submit(start).result(), log_path)

    def close(self) -> None:
        """End the spawning thread; call after every child has been stopped."""
        self._thread.shutdown(wait=True)


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not sys.platform.startswith("linux")
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
