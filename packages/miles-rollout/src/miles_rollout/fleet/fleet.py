"""A fleet: N engine processes behind one sglang-router, watched until closed.

    with FleetConfig(model_path="./ckpt", engines=2).build() as fleet:
        client = SGLangClient(fleet.url)     # the router; send X-SMG-Routing-Key per session

Start-up: all engines start at once; each must answer ``/health``; then the router starts with
their URLs, and the fleet waits until the router lists every (engine, rank) as a healthy worker.
A failure anywhere stops everything already started and raises :class:`StartupError` with the
failing process's log. While it runs a monitor thread notices an engine that exits, reports it
(log, :attr:`Fleet.events`, :meth:`Fleet.metrics`), optionally starts a replacement, and turns
the router's ``occupied_miss`` decisions into "sessions moved" reports.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from miles_rollout.fleet.config import FleetConfig
from miles_rollout.fleet.engines import (
    EngineCommand,
    StartupError,
    free_port,
    wait_for,
    wait_healthy,
)
from miles_rollout.fleet.launcher import FleetProcess, Launcher, make_launcher
from miles_rollout.fleet.router import RouterAPI, find_router, router_argv

__all__ = ["EngineHandle", "Fleet", "FleetEvent"]

logger = logging.getLogger(__name__)

_STATS_INTERVAL_S = 2.0  # engines' /get_server_info and the router's counters
_CACHE_TOKENS = "prefix_cache_tokens"  # the embedded engine's counter (summed over DP ranks)


@dataclass(slots=True)
class EngineHandle:
    """One engine of the fleet: ``index`` (never reused), ``url``, its process, liveness."""

    index: int
    url: str
    process: FleetProcess
    alive: bool = True
    exit_status: int | None = None
    last_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """Something the fleet reports: ``kind`` is ``engine_added``, ``engine_died``,
    ``sessions_moved`` or ``router_died``; ``detail`` holds the numbers."""

    kind: str
    message: str
    time: float
    engine: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Fleet:
    """N engines and an sglang-router (see the module docstring). Build with
    :meth:`FleetConfig.build`; ``start()`` / ``close()`` or ``with``."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.engines: list[EngineHandle] = []
        self.events: list[FleetEvent] = []
        self.router: FleetProcess | None = None
        self.url = ""
        self._api: RouterAPI | None = None
        self._log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="miles-fleet-"))
        self._launcher: Launcher | None = None  # where the processes run (made by start())
        self._lock = threading.RLock()  # engines, events, counters
        # One process check at a time (the monitor's and metrics()'s): a death is seen once.
        self._check_lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._replacements: list[threading.Thread] = []
        self._closed = False
        self._router_died = False
        self._sessions_moved = 0.0
        self._branches_seen: dict[str, float] = {}
        self._next_stats = 0.0

    # ---------------------------------------------------------------- lifecycle

    @property
    def log_dir(self) -> Path:
        """Where ``engine-<i>.log`` and ``router.log`` are written."""
        return self._log_dir

    def start(self) -> Fleet:
        """Start the engines and the router; return once the router routes to all of them.

        Raises:
            StartupError: a process exited or missed ``startup_timeout_s`` (everything already
                started is stopped first).
            FileNotFoundError: no ``sglang-router`` executable.
        """
        assert not self.engines, "start() runs once"
        assert not self._closed, "start() runs once"
        pending: list[tuple[int, FleetProcess, EngineCommand, str]] = []
        try:
            binary = find_router(self.config.router_binary)
            deadline = time.monotonic() + self.config.startup_timeout_s
            self._launcher = make_launcher(self.config)
            for i in range(self.config.engines):
                pending.append(self._spawn_engine(i))
            for index, child, command, host in pending:
                url = wait_healthy(child, command, host, deadline)
                self.engines.append(EngineHandle(index=index, url=url, process=child))
            self._start_router(binary, deadline)
        except BaseException:
            started = {id(e.process) for e in self.engines}
            for _, child, _, _ in pending:
                if id(child) not in started:
                    child.stop(self.config.stop_timeout_s)
            self.close()
            raise
        self._poll_stats()  # a baseline, so even an engine that dies at once has counters
        self._monitor = threading.Thread(target=self._watch, name="fleet-monitor", daemon=True)
        self._monitor.start()
        return self

    def close(self) -> None:
        """Stop the monitor, the router and every engine (SIGTERM, then SIGKILL); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        for thread in self._replacements:  # they see the stop and stop their engine
            thread.join()
        timeout = self.config.stop_timeout_s
        if self.router is not None:
            self.router.stop(timeout)
        for engine in self.engines:
            engine.process.stop(timeout)
            engine.alive = False
        if self._launcher is not None:
            self._launcher.close()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def failed(self) -> bool:
        """True once the router process has died (the fleet cannot route any more)."""
        return self._router_died

    @property
    def engine_urls(self) -> list[str]:
        """The base URLs of the live engines (weight updates go to each, not to the router)."""
        with self._lock:
            return [e.url for e in self.engines if e.alive]

    @property
    def pids(self) -> list[int]:
        """The PIDs of every process this fleet started (router last)."""
        pids = [e.pid for e in self.engines]
        return pids + ([self.router.pid] if self.router is not None else [])

    # ---------------------------------------------------------------- engines

    def _spawn_engine(self, index: int) -> tuple[int, FleetProcess, EngineCommand, str]:
        assert self._launcher is not None, "start() the fleet first"
        log = self._log_dir / f"engine-{index}.log"
        child, command, host = self._launcher.start_engine(self.config, index, log)
        return index, child, command, host

    def _worker_urls(self, url: str) -> set[str]:
        """The router's worker URLs for one engine (one per DP rank with ``--dp-aware``)."""
        args = {k.replace("-", "_"): v for k, v in self.config.router_args.items()}
        if not args.get("dp_aware", True):
            return {url}
        return {f"{url}@{rank}" for rank in range(self.config.dp_size)}

    def _routes_to(self, worker_urls: set[str]) -> bool:
        assert self._api is not None
        return worker_urls <= self._api.healthy_worker_urls()

    def _wait_registered(self, url: str, child: FleetProcess, deadline: float) -> None:
        router, want = self.router, self._worker_urls(url)
        assert router is not None
        wait_for(
            lambda: self._routes_to(want) and router.poll() is None,
            child=child,
            what=f"the router listing {sorted(want)} as healthy",
            deadline=deadline,
            interval_s=0.2,
            cancel=self._stop,
        )

    def add_engine(self) -> EngineHandle:
        """Start one more engine and register it with the running router (``POST /workers``).

        Returns:
            its handle, once the router lists all its ranks as healthy workers.

        Raises:
            StartupError: it did not come up (it is stopped again).
        """
        assert self._api is not None, "start() the fleet first"
        with self._lock:
            index = max((e.index for e in self.engines), default=-1) + 1
        _, child, command, host = self._spawn_engine(index)
        deadline = time.monotonic() + self.config.startup_timeout_s
        try:
            url = wait_healthy(child, command, host, deadline, cancel=self._stop)
            self._api.add_worker(url)
            self._wait_registered(url, child, deadline)
        except BaseException:
            child.stop(self.config.stop_timeout_s)
            raise
        handle = EngineHandle(index=index, url=url, process=child)
        with self._lock:
            self.engines.append(handle)
        self._event("engine_added", f"engine {index} (pid {child.pid}) joined at {url}", index)
        return handle

    # ---------------------------------------------------------------- router

    def _start_router(self, binary: str, deadline: float) -> None:
        cfg = self.config
        urls = [e.url for e in self.engines]
        # A port picked here may be taken before the router binds it; retry then.
        for attempt in range(3):
            port = cfg.router_port or free_port(cfg.host)
            metrics_port = free_port(cfg.host)
            argv = router_argv(
                binary,
                urls,
                host=cfg.host,
                port=port,
                prometheus_port=metrics_port,
                router_args=cfg.router_args,
                api_key=cfg.api_key,
            )
            assert self._launcher is not None
            self.router = self._launcher.spawn("router", argv, self._log_dir / "router.log")
            self.url = f"http://{cfg.host}:{port}"
            self._api = RouterAPI(
                self.url, f"http://{cfg.host}:{metrics_port}/metrics", api_key=cfg.api_key
            )
            try:
                wanted: set[str] = set().union(*(self._worker_urls(u) for u in urls))
                wait_for(
                    functools.partial(self._routes_to, wanted),
                    child=self.router,
                    what=f"routing to all {len(wanted)} workers",
                    deadline=deadline,
                    interval_s=0.2,
                )
                return
            except StartupError:
                in_use = "ddress already in use" in self.router.log_tail()
                self.router.stop(cfg.stop_timeout_s)
                if cfg.router_port or not in_use or attempt == 2:
                    raise

    # ---------------------------------------------------------------- monitoring

    def _event(self, kind: str, message: str, engine: int | None = None, **detail: Any) -> None:
        level = logging.INFO if kind == "engine_added" else logging.WARNING
        if kind == "router_died":
            level = logging.ERROR
        logger.log(level, "fleet: %s", message)
        with self._lock:
            self.events.append(FleetEvent(kind, message, time.time(), engine, dict(detail)))

    def _watch(self) -> None:
        interval = self.config.monitor_interval_s
        while not self._stop.wait(interval):
            try:
                self._check_processes()
                self._poll_stats()
            except Exception:  # a monitoring hiccup must not end monitoring
                logger.exception("fleet: monitor step failed")

    def _check_processes(self) -> None:
        with self._check_lock:
            self._check_processes_locked()

    def _check_processes_locked(self) -> None:
        if self.router is not None and not self._router_died:
            status = self.router.poll()
            if status is not None:
                self._router_died = True
                self._event(
                    "router_died",
                    f"the router (pid {self.router.pid}) exited with status {status}; "
                    f"the fleet cannot route. Last lines of {self.router.log_path}:\n"
                    f"{self.router.log_tail(10)}",
                    status=status,
                )
        with self._lock:
            engines = list(self.engines)
        for engine in engines:
            if not engine.alive:
                continue
            status = engine.process.poll()
            if status is None:
                continue
            engine.alive, engine.exit_status = False, status
            lost = engine.last_stats.get(_CACHE_TOKENS)
            cache = (
                f"the {lost:g} tokens its prefix cache held at the last poll are lost"
                if lost is not None
                else "its prefix cache is lost"
            )
            self._event(
                "engine_died",
                f"engine {engine.index} (pid {engine.pid}, {engine.url}) exited with status "
                f"{status}; {cache}. Its sessions move to other engines at their next turn "
                "(the router retries, then its circuit breaker and health check take the "
                "engine out) and re-prefill there",
                engine.index,
                status=status,
                cache_tokens_lost=lost,
                last_stats=dict(engine.last_stats),
            )
            if self.config.replace_dead_engines and not self._stop.is_set():
                # In its own thread: monitoring goes on while the replacement loads.
                thread = threading.Thread(
                    target=self._replace, args=(engine.index,), name="fleet-replace", daemon=True
                )
                self._replacements.append(thread)
                thread.start()

    def _replace(self, dead: int) -> None:
        try:
            self.add_engine()
        except Exception as exc:
            if not self._stop.is_set():
                logger.error("fleet: could not replace engine %d: %s", dead, exc)

    def _poll_stats(self) -> None:
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + _STATS_INTERVAL_S
        for engine in list(self.engines):
            if engine.alive:
                stats = _engine_stats(engine.url, self.config.api_key)
                if stats:
                    engine.last_stats = stats
        if self._api is None or self._router_died:
            return
        branches = self._api.policy_branches()
        moved = branches.get("occupied_miss", 0.0) - self._branches_seen.get("occupied_miss", 0.0)
        if branches:
            self._branches_seen = branches
        if moved > 0:
            with self._lock:
                self._sessions_moved += moved
            self._event(
                "sessions_moved",
                f"{moved:g} session(s) found their engine gone or unhealthy and moved to "
                "another one; their prefix cache there is lost (they re-prefill)",
                moved=moved,
            )

    def metrics(self) -> dict[str, float]:
        """Namespaced numbers: engine counts, deaths, sessions moved, prefix-cache tokens lost
        with dead engines, the router's routing decisions (``fleet/router/<branch>``) and each
        engine's last polled counters (``fleet/engine<i>/<name>``, summed over DP ranks).

        Process exits are checked here too (a non-blocking poll), not only by the monitor
        every ``monitor_interval_s``: an engine that died during a step is in that step's row."""
        if not self._closed:
            self._check_processes()
        with self._lock:
            engines = list(self.engines)
            out: dict[str, float] = {
                "fleet/engines_alive": sum(e.alive for e in engines),
                "fleet/engines_started": len(engines),
                "fleet/engine_deaths": sum(e.exit_status is not None for e in engines),
                "fleet/sessions_moved": self._sessions_moved,
                "fleet/cache_tokens_lost": sum(
                    e.last_stats.get(_CACHE_TOKENS, 0.0)
                    for e in engines
                    if e.exit_status is not None
                ),
            }
        for branch, value in self._branches_seen.items():
            out[f"fleet/router/{branch}"] = value
        for e in engines:
            for name, value in e.last_stats.items():
                out[f"fleet/engine{e.index}/{name}"] = value
        return out


def _engine_stats(url: str, api_key: str | None) -> dict[str, float]:
    """The numeric ``internal_states`` of ``/get_server_info``, summed over DP ranks."""
    from miles_rollout.auth import auth_headers

    req = urllib.request.Request(url + "/get_server_info", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=2.0) as resp:
            info = json.loads(resp.read())
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for state in info.get("internal_states") or []:
        for name, value in state.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[name] = out.get(name, 0.0) + value
    return out
