"""The sglang-router in front of the engines: its command line and its management API.

What sglang-router 0.3.2 needs and does (probed here; see REFERENCE.md): ``--policy manual
--assignment-mode min_load`` keeps every ``X-SMG-Routing-Key`` on the worker it first went to
and sends a new key to the worker with the fewest requests in flight; ``--dp-aware`` makes each
DP rank of an engine its own worker (``http://host:port@rank``). ``POST /workers {"url"}`` adds
an engine at run time. ``DELETE /workers/{id}`` fails in 0.3.2 for ``--dp-aware`` workers (it
looks for ``url@rank@``), so a dead engine stays listed, unhealthy, and receives nothing.
Its Prometheus counters ``smg_manual_policy_branch_total{branch=...}`` count routing decisions:
``vacant`` (a new key), ``occupied_hit`` (a key on its worker), ``occupied_miss`` (a key whose
worker is gone or unhealthy: the session moved).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_rollout.fleet.sglang import cli_flags

__all__ = ["ROUTER_DEFAULTS", "RouterAPI", "find_router", "parse_prometheus", "router_argv"]

# Our defaults on top of sglang-router's. Health checks every 2 s with 2 failures to mark a
# worker down (its defaults, 60 s x 3, leave keys pinned to a dead engine for minutes), the
# circuit breaker opens after 3 failed requests (default 10), and shutdown does not wait 180 s
# for requests in flight (the fleet is stopping its engines anyway).
ROUTER_DEFAULTS: dict[str, Any] = {
    "policy": "manual",
    "assignment_mode": "min_load",
    "dp_aware": True,
    "health_check_interval_secs": 2,
    "health_failure_threshold": 2,
    "cb_failure_threshold": 3,
    "shutdown_grace_period_secs": 2,
    "log_level": "warn",
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def find_router(explicit: str | None = None) -> str:
    """The ``sglang-router`` executable: ``explicit``, ``$MILES_SGLANG_ROUTER``, the one next to
    this Python (a venv), or ``PATH``.

    Raises:
        FileNotFoundError: none found (with the install command).
    """
    candidate = explicit or os.environ.get("MILES_SGLANG_ROUTER")
    if candidate:
        if shutil.which(candidate) is None:
            raise FileNotFoundError(f"the sglang-router executable {candidate!r} does not exist")
        return candidate
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("sglang-router", path=path)
    if found is None:
        raise FileNotFoundError(
            "sglang-router is not installed: pip install 'miles-rollout[fleet]' "
            "(or pip install sglang-router), or set MILES_SGLANG_ROUTER"
        )
    return found


def router_argv(
    binary: str,
    worker_urls: Sequence[str],
    *,
    host: str,
    port: int,
    prometheus_port: int,
    router_args: Mapping[str, Any],
    api_key: str | None = None,
) -> list[str]:
    """``sglang-router launch ...`` with :data:`ROUTER_DEFAULTS` updated by ``router_args``;
    ``api_key``: ``--api-key`` (demanded from clients, sent on to the workers)."""
    args = {**ROUTER_DEFAULTS, **{k.replace("-", "_"): v for k, v in router_args.items()}}
    if api_key is not None:
        args["api_key"] = api_key
    argv = [binary, "launch", "--worker-urls", *worker_urls]
    argv += ["--host", host, "--port", str(port)]
    argv += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    return argv + cli_flags(args)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> ``[(name, labels, value)]`` (comments skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


class RouterAPI:
    """Blocking calls to the router's management endpoints and its Prometheus exporter."""

    def __init__(
        self, url: str, metrics_url: str, timeout_s: float = 5.0, api_key: str | None = None
    ) -> None:
        self.url = url
        self.metrics_url = metrics_url
        self.timeout_s = timeout_s
        self._api_key = api_key

    def _call(self, method: str, url: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: one entry per worker (per DP rank with ``--dp-aware``); [] if the
        router does not answer yet."""
        try:
            status, raw = self._call("GET", self.url + "/workers")
        except OSError:
            return []
        if status != 200:
            return []
        return list(json.loads(raw).get("workers", []))

    def healthy_worker_urls(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}

    def add_worker(self, url: str) -> None:
        """``POST /workers {"url": url}`` (queued by the router; poll :meth:`workers`).

        Raises:
            RuntimeError: the router refused it.
        """
        body = {"url": url}
        if self._api_key:
            # A worker added at run time gets only the key named here (the launch --api-key
            # covers the launch --worker-urls).
            body["api_key"] = self._api_key
        status, raw = self._call("POST", self.url + "/workers", body)
        if status >= 300:
            raise RuntimeError(f"the router refused to add {url}: HTTP {status} {raw[:300]!r}")

    def remove_worker(self, worker_id: str) -> int:
        """``DELETE /workers/{id}``; returns the HTTP status (see the module docstring)."""
        try:
            return self._call("DELETE", f"{self.url}/workers/{worker_id}")[0]
        except OSError:
            return 0

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """The router's Prometheus samples; [] if the exporter does not answer."""
        try:
            status, raw = self._call("GET", self.metrics_url)
        except OSError:
            return []
        return parse_prometheus(raw.decode(errors="replace")) if status == 200 else []

    def policy_branches(self) -> dict[str, float]:
        """``smg_manual_policy_branch_total`` by branch (vacant, occupied_hit, occupied_miss)."""
        return {
            labels.get("branch", ""): value
            for name, labels, value in self.metrics()
            if name == "smg_manual_policy_branch_total"
        }
