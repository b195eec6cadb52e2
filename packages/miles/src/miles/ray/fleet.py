"""The fleet's processes as Ray actors: ``FleetConfig.launcher = "miles.ray.fleet:RayLauncher"``.

``miles train --ray`` sets this on the fleet that rank 0 starts. Each engine is a
:class:`~miles.ray.processes.ProcessActor` in its own bundle of the engines' placement group
(made by the launcher in :mod:`miles.ray.launcher`), bound to 127.0.0.1 or to its node's
address; the router is one on rank 0's node, where the fleet picks its ports and talks to it.
The fleet itself (health waits, router registration, the monitor, replacements of dead
engines, weight fan-out) is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.ray._import import import_ray
from miles.ray.processes import ProcessActor, RayProcess
from miles_rollout.fleet import FleetConfig, StartupError
from miles_rollout.fleet.engines import EngineCommand

__all__ = ["RayLauncher"]


class RayLauncher:
    """A ``miles_rollout.fleet.launcher.Launcher`` that places processes with Ray.

    Args:
        config: the fleet (its ``engines`` bundles are made ready up front).
        placement_group: the name of the engines' placement group (one bundle per engine).
        cpus: CPUs each engine actor takes from its bundle.
        gpus: GPUs each engine actor takes from its bundle.
        engine_host: ``loopback`` or ``node`` (see ``miles.ray.RaySettings.engine_host``).
        env: variables every process actor sets first.
    """

    def __init__(
        self,
        config: FleetConfig,
        *,
        placement_group: str,
        cpus: float,
        gpus: float,
        engine_host: str = "loopback",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._ray = import_ray()
        self._pg = self._ray.util.get_placement_group(placement_group)
        self._bundles = self._pg.bundle_count
        self._cpus, self._gpus, self._host = cpus, gpus, engine_host
        self._env = dict(env or {})
        self._timeout_s = config.startup_timeout_s
        self._actor_class = self._ray.remote(ProcessActor)
        self._lock = threading.Lock()
        self._in_use: dict[int, RayProcess | None] = {}  # bundle -> its engine (None: starting)
        self._actors: list[Any] = []
        # Every engine's actor starts now, so they import and come up side by side.
        self._idle = [(b, self._new_actor(b)) for b in range(min(config.engines, self._bundles))]
        self._router_actor: Any = self._router_process_actor()

    def _new_actor(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self._actor_class.options(
            num_cpus=self._cpus,
            num_gpus=self._gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=bundle
            ),
        ).remote(self._env)
        self._actors.append(actor)
        return actor

    def _take(self) -> tuple[int, Any]:
        """An idle actor, else a new one in a bundle no live engine holds."""
        with self._lock:
            if self._idle:
                bundle, actor = self._idle.pop(0)
                self._in_use[bundle] = None
                return bundle, actor
            exited = [p for p in self._in_use.values() if p is not None and p.exited()]
        for proc in exited:  # a dead engine's actor still holds its bundle: free it
            proc.release()
        with self._lock:
            free = [b for b in range(self._bundles) if b not in self._in_use]
            if not free:
                raise StartupError(
                    f"every bundle of the engines' placement group ({self._bundles}) holds a "
                    "running engine: no room for another one"
                )
            self._in_use[free[0]] = None
            return free[0], self._new_actor(free[0])

    def _free(self, bundle: int) -> None:
        with self._lock:
            self._in_use.pop(bundle, None)

    def start_engine(
        self, config: FleetConfig, index: int, log_path: Path
    ) -> tuple[RayProcess, EngineCommand, str]:
        bundle, actor = self._take()
        try:
            pid, command, host = self._ray.get(
                actor.start_engine.remote(config, index, str(log_path), self._host),
                timeout=self._timeout_s,
            )
        except BaseException:
            self._ray.kill(actor, no_restart=True)
            self._free(bundle)
            raise
        proc = RayProcess(
            f"engine {index}", actor, pid, log_path, on_stop=lambda: self._free(bundle)
        )
        with self._lock:
            self._in_use[bundle] = proc
        return proc, command, host

    def spawn(self, name: str, argv: Sequence[str], log_path: Path) -> RayProcess:
        actor, self._router_actor = self._router_actor, None
        if actor is None:  # the fleet starts its router again (its port was taken)
            actor = self._router_process_actor()
        pid = self._ray.get(actor.spawn.remote(name, list(argv), str(log_path)))
        return RayProcess(name, actor, pid, log_path)

    def _router_process_actor(self) -> Any:
        """An actor on this node (rank 0's) for the router, taking no CPU from the run."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = self._ray.get_runtime_context().get_node_id()
        actor = self._actor_class.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
        ).remote(self._env)
        self._actors.append(actor)
        return actor

    def close(self) -> None:
        """Kill every actor this launcher made (their processes die with them)."""
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._idle.clear()
