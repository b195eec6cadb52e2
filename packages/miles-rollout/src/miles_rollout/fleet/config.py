"""The fleet's configuration: how many engines of which backend, and the router in front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_rollout.fleet.fleet import Fleet

__all__ = ["BACKENDS", "FleetConfig"]

BACKENDS = ("embedded", "sglang", "command")
# Flags the fleet sets itself from FleetConfig fields; passing them again would conflict.
_OWNED_FLAGS = {"model_path": "model_path", "host": "host", "port": "port", "dp_size": "dp_size"}
_OWNED_ROUTER_FLAGS = {"worker_urls", "host", "port", "prometheus_host", "prometheus_port"}


@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """N inference engines behind one sglang-router, all on this machine, bound to ``host``.

    Attributes:
        model_path: the local HF checkpoint every engine serves.
        engines: how many engine processes to start.
        dp_size: data-parallel ranks per engine (``--dp-size`` of each engine). With the
            router's ``--dp-aware`` each rank is its own worker, so a session sticks to one
            (engine, rank).
        backend: ``"embedded"`` (``miles-rollout serve``, CPU), ``"sglang"``
            (``python -m sglang.launch_server``, GPU) or ``"command"`` (``command`` below).
        router_port: the router's port; ``0`` picks a free one.
        host: the address every process binds (loopback unless the fleet must be reachable
            from other machines).
        engine_args: extra ``miles-rollout serve`` flags for the embedded backend, e.g.
            ``{"dtype": "bfloat16", "num_threads": 1}`` -> ``--dtype bfloat16 --num-threads 1``
            (``True`` is a bare flag; ``seed`` is offset by the engine index so engines draw
            different random streams).
        sglang_args: extra ``sglang.launch_server`` flags for the sglang backend, e.g.
            ``{"tp_size": 2, "enable_dp_attention": True}`` (the CLI's ``--sglang-tp-size 2``).
        sglang_python: the Python that has SGLang installed (default: this one).
        command: the backend ``"command"``: an argv whose items may hold ``{port}``,
            ``{host}``, ``{model_path}``, ``{dp_size}`` and ``{index}``; any server with
            SGLang's HTTP API (``/health``, ``/server_info`` with ``dp_size``, ``/generate``).
        router_args: extra or overriding ``sglang-router launch`` flags, e.g.
            ``{"policy": "round_robin"}`` or ``{"dp_aware": False}``; defaults in
            :data:`miles_rollout.fleet.router.ROUTER_DEFAULTS`.
        router_binary: the ``sglang-router`` executable; default: ``$MILES_SGLANG_ROUTER``,
            then next to this Python, then ``PATH``.
        engine_env: extra environment variables for the engine processes.
        replace_dead_engines: start a new engine (and register it with the router) whenever
            one dies.
        log_dir: where each process's log goes (``engine-<i>.log``, ``router.log``); default
            a new temporary directory, kept after :meth:`Fleet.close` for post-mortems.
        startup_timeout_s: how long an engine may take to become healthy and registered.
        stop_timeout_s: how long a process gets after SIGTERM before SIGKILL.
        monitor_interval_s: how often the fleet checks its processes and the router's
            counters.
        weight_format: the precision every engine serves (``EngineConfig.weight_format``):
            ``--weight-format`` of the embedded backend, SGLang's ``--quantization`` /
            ``--dtype`` for the sglang backend (``fleet.sglang.quantization_args``).
        api_key: every engine and the router demand ``Authorization: Bearer <api_key>``
            (the router sends it on to the engines); ``None``: no auth. The embedded engines
            get it as ``MILES_API_KEY`` in their environment (not on a command line that
            ``ps`` shows); SGLang and the router take ``--api-key``.
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.
        launcher: where the processes run: ``None`` forks them here; a dotted path
            ``pkg.module:factory`` names ``factory(config, **launcher_args) ->
            miles_rollout.fleet.launcher.Launcher`` (``miles train --ray`` sets
            ``miles.ray.fleet:RayLauncher``: each process owned by a Ray actor).
        launcher_args: keyword arguments for the ``launcher`` factory.
    """

    model_path: str
    engines: int = 1
    dp_size: int = 1
    backend: str = "embedded"
    router_port: int = 0
    host: str = "127.0.0.1"
    engine_args: dict[str, Any] = field(default_factory=dict)
    sglang_args: dict[str, Any] = field(default_factory=dict)
    sglang_python: str | None = None
    command: list[str] | None = None
    router_args: dict[str, Any] = field(default_factory=dict)
    router_binary: str | None = None
    engine_env: dict[str, str] = field(default_factory=dict)
    replace_dead_engines: bool = False
    log_dir: str | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0
    monitor_interval_s: float = 0.5
    weight_format: str | None = None
    api_key: str | None = None
    insecure_no_auth: bool = False
    launcher: str | None = None
    launcher_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a checkpoint directory, got {self.model_path!r}")
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if not 0 <= self.router_port < 65536:
            raise ValueError(
                f"router_port must be in 0..65535 (0: a free port), got {self.router_port}"
            )
        for name, args, backend in (
            ("engine_args", self.engine_args, "embedded"),
            ("sglang_args", self.sglang_args, "sglang"),
        ):
            if args and self.backend != backend:
                raise ValueError(
                    f"{name} is for backend {backend!r}; this fleet's backend is {self.backend!r}"
                )
            for key in args:
                owned = _OWNED_FLAGS.get(key.replace("-", "_"))
                if owned is not None:
                    raise ValueError(
                        f"{name}[{key!r}] is set by the fleet: use FleetConfig.{owned} instead"
                    )
        if self.backend == "command":
            if not self.command or not any("{port}" in part for part in self.command):
                raise ValueError(
                    "backend 'command' needs command: an argv list holding {port} (and optionally "
                    "{host}, {model_path}, {dp_size}, {index}), e.g. "
                    "['my-server', '--port', '{port}']"
                )
        elif self.command is not None:
            raise ValueError(
                f"command is for backend 'command'; this fleet's backend is {self.backend!r}"
            )
        for key in self.router_args:
            if key.replace("-", "_") in _OWNED_ROUTER_FLAGS:
                raise ValueError(
                    f"router_args[{key!r}] is set by the fleet (use router_port / host); "
                    f"the fleet passes its engines' URLs itself"
                )
        if self.launcher is not None and ":" not in self.launcher:
            raise ValueError(
                f"launcher must be a dotted path pkg.module:factory, got {self.launcher!r}"
            )
        if self.launcher_args and self.launcher is None:
            raise ValueError("launcher_args is for a launcher: set launcher too")
        for name in ("startup_timeout_s", "stop_timeout_s", "monitor_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name, args in (("engine_args", self.engine_args), ("sglang_args", self.sglang_args)):
            if any(k.replace("-", "_") in ("api_key", "insecure_no_auth") for k in args):
                raise ValueError(f"{name} sets the API key: use FleetConfig.api_key instead")
        if any(k.replace("-", "_") == "api_key" for k in self.router_args):
            raise ValueError("router_args sets the API key: use FleetConfig.api_key instead")
        from miles_rollout.auth import check_bind, resolve_api_key

        if self.api_key is not None:
            resolve_api_key(self.api_key)  # the same rules as --api-key
        check_bind(
            self.host, self.api_key, insecure_no_auth=self.insecure_no_auth, what="the fleet"
        )

    def build(self) -> Fleet:
        """The fleet, not started yet: call :meth:`Fleet.start` or use it as a context manager."""
        from miles_rollout.fleet.fleet import Fleet

        return Fleet(self)
