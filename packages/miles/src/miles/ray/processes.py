"""A fleet process owned by a Ray actor: the actor starts it on its node and it dies with it.

:class:`ProcessActor` runs on whatever node Ray placed it; it forks the process with the fleet's
own spawner (its own session, ``PR_SET_PDEATHSIG``), so when the actor goes (killed, its owner
gone, its node lost) the process goes too. :class:`RayProcess` is the fleet's view of it (the
``miles_rollout.fleet.launcher.FleetProcess`` protocol), each call a call on the actor.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.ray._import import import_ray

__all__ = ["ProcessActor", "RayProcess"]

# How long one call on the actor may take (poll and the logs answer at once; stop waits for
# the process first).
_CALL_TIMEOUT_S = 60.0
_GONE = -int(signal.SIGKILL)  # the status of a process whose actor is gone


class ProcessActor:
    """Owns one process on this node (a Ray actor class; see the module docstring).

    Args:
        env: variables set in this worker before anything else (and so in the process).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        from miles_rollout.fleet.processes import ChildProcess, Spawner

        self._spawner = Spawner()
        self._child: ChildProcess | None = None

    def node_ip(self) -> str:
        """This node's IP address as Ray knows it."""
        ray = import_ray()
        return str(ray.util.get_node_ip_address())

    def start_engine(
        self, config: Any, index: int, log_path: str, engine_host: str
    ) -> tuple[int, Any, str]:
        """Start engine ``index`` of the fleet ``config`` here; return (pid, command, host).

        ``engine_host`` ``loopback`` binds 127.0.0.1, ``node`` this node's IP address. An
        SGLang engine counts its GPUs from 0 (Ray gave this actor its own
        ``CUDA_VISIBLE_DEVICES``) unless ``sglang_args`` sets ``base_gpu_id``.
        """
        from miles_rollout.fleet.engines import engine_command, engine_env

        host = "127.0.0.1" if engine_host == "loopback" else self.node_ip()
        changes: dict[str, Any] = {"host": host, "launcher": None, "launcher_args": {}}
        if config.backend == "sglang" and "base_gpu_id" not in config.sglang_args:
            changes["sglang_args"] = {**config.sglang_args, "base_gpu_id": 0}
        config = dataclasses.replace(config, **changes)
        command = engine_command(config, index)
        self._child = self._spawner.spawn(
            f"engine {index}", command.argv, Path(log_path), engine_env(config)
        )
        return self._child.pid, command, host

    def spawn(self, name: str, argv: Sequence[str], log_path: str) -> int:
        """Start ``argv`` here (its output to ``log_path``); return its pid."""
        self._child = self._spawner.spawn(name, argv, Path(log_path))
        return self._child.pid

    def poll(self) -> int | None:
        assert self._child is not None
        return self._child.poll()

    def stop(self, timeout_s: float) -> int:
        assert self._child is not None
        status = self._child.stop(timeout_s)
        self._spawner.close()
        return status

    def log_tail(self, lines: int) -> str:
        return self._child.log_tail(lines) if self._child is not None else ""

    def read_log(self) -> bytes:
        return self._child.read_log() if self._child is not None else b""


class RayProcess:
    """The fleet's handle on a process a :class:`ProcessActor` owns.

    An actor that is gone (killed, its node lost) reads as a process killed by SIGKILL.
    ``on_stop`` runs once the process is stopped and its actor killed (the launcher frees the
    actor's placement-group bundle then).
    """

    def __init__(
        self,
        name: str,
        actor: Any,
        pid: int,
        log_path: Path,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.actor = actor
        self._pid = pid
        self._log_path = log_path
        self._status: int | None = None
        self._on_stop = on_stop
        self._ray = import_ray()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def _call(self, method: str, *args: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        return self._ray.get(ref, timeout=_CALL_TIMEOUT_S)

    def poll(self) -> int | None:
        if self._status is not None:
            return self._status
        try:
            status = self._call("poll")
        except self._ray.exceptions.GetTimeoutError:
            return None  # busy, not gone
        except self._ray.exceptions.RayActorError:
            status = _GONE
        self._status = status
        return status

    def exited(self) -> bool:
        """Whether the process was seen to exit (without asking the actor again)."""
        return self._status is not None

    def stop(self, timeout_s: float) -> int:
        try:
            ref = self.actor.stop.remote(timeout_s)
            status = self._ray.get(ref, timeout=timeout_s + _CALL_TIMEOUT_S)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            status = self._status if self._status is not None else _GONE
        self._status = status
        self.release()
        return int(status)

    def release(self) -> None:
        """Kill the actor (the process, if still running, dies with it); idempotent."""
        self._ray.kill(self.actor, no_restart=True)
        if self._on_stop is not None:
            on_stop, self._on_stop = self._on_stop, None
            on_stop()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return str(self._call("log_tail", lines))
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            return f"(the log is on the node of a Ray actor that is gone: {self._log_path})"

    def read_log(self) -> bytes:
        try:
            return bytes(self._call("read_log"))
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            return b""
