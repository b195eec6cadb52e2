"""Where a fleet's processes run: children of this process (the default), or placed elsewhere.

The fleet starts its engines and its router through a :class:`Launcher`. The default,
:class:`LocalLauncher`, forks them here (:class:`~miles_rollout.fleet.processes.Spawner`).
``FleetConfig.launcher`` names another by dotted path, e.g. ``miles.ray.fleet:RayLauncher``,
which places every process with a Ray actor on some node of a cluster. Whatever runs them, the
fleet only sees a :class:`FleetProcess` per process: poll, stop, read the log.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from miles_rollout.fleet.processes import Spawner

if TYPE_CHECKING:
    from miles_rollout.fleet.config import FleetConfig
    from miles_rollout.fleet.engines import EngineCommand

__all__ = ["FleetProcess", "Launcher", "LocalLauncher", "make_launcher"]


class FleetProcess(Protocol):
    """One process of the fleet, wherever it runs (``ChildProcess`` is the local one)."""

    name: str

    @property
    def pid(self) -> int:
        """Its process id (on the machine it runs on)."""
        ...

    @property
    def log_path(self) -> Path:
        """Its log file (on the machine it runs on)."""
        ...

    def poll(self) -> int | None:
        """The exit status once it has exited, else ``None``."""
        ...

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, SIGKILL after ``timeout_s``; return the exit status."""
        ...

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of its log."""
        ...

    def read_log(self) -> bytes:
        """Its whole log so far (the embedded engine announces its URL there)."""
        ...


class Launcher(Protocol):
    """Starts the fleet's processes. ``start_engine`` returns the process, the command it runs
    and the address its URL uses; ``spawn`` starts the router beside the fleet (the fleet picks
    the router's ports on its own machine and talks to it there)."""

    def start_engine(
        self, config: FleetConfig, index: int, log_path: Path
    ) -> tuple[FleetProcess, EngineCommand, str]: ...

    def spawn(self, name: str, argv: Sequence[str], log_path: Path) -> FleetProcess: ...

    def close(self) -> None:
        """Release what the launcher holds; called after every process was stopped."""
        ...


class LocalLauncher:
    """Every process is a child of this one (its own session, dies with it)."""

    def __init__(self) -> None:
        self._spawner = Spawner()

    def start_engine(
        self, config: FleetConfig, index: int, log_path: Path
    ) -> tuple[FleetProcess, EngineCommand, str]:
        from miles_rollout.fleet.engines import engine_command, engine_env

        command = engine_command(config, index)
        child = self._spawner.spawn(f"engine {index}", command.argv, log_path, engine_env(config))
        return child, command, config.host

    def spawn(self, name: str, argv: Sequence[str], log_path: Path) -> FleetProcess:
        return self._spawner.spawn(name, argv, log_path)

    def close(self) -> None:
        self._spawner.close()


def make_launcher(config: FleetConfig) -> Launcher:
    """The launcher ``config`` asks for: ``config.launcher`` (``pkg.module:factory``, called
    as ``factory(config, **config.launcher_args)``) or a :class:`LocalLauncher`.

    Raises:
        ImportError: the module does not import.
        ValueError: it has no such attribute.
    """
    if config.launcher is None:
        return LocalLauncher()
    module_name, _, attr = config.launcher.partition(":")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(
            f"fleet.launcher {config.launcher!r}: {module_name} has no callable {attr!r}"
        )
    args: Mapping[str, object] = config.launcher_args
    launcher: Launcher = factory(config, **args)
    return launcher
