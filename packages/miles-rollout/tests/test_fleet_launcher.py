"""Where the fleet's processes run: the default launcher (children of this process) and one
named by ``FleetConfig.launcher`` (``miles train --ray`` names a Ray one; it runs in
tests/test_e2e_ray.py). Real child processes, no model."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles_rollout.fleet import FleetConfig, StartupError
from miles_rollout.fleet.engines import wait_healthy
from miles_rollout.fleet.launcher import LocalLauncher, make_launcher
from miles_rollout.fleet.processes import wait_gone
from miles_rollout.fleet.router import find_router

_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
print("listening on", sys.argv[1], flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# A launcher module as a user would write one: it wraps the local launcher and records what
# the fleet asked of it.
_RECORDING = textwrap.dedent(
    """
    from miles_rollout.fleet.launcher import LocalLauncher

    class Recording(LocalLauncher):
        made = []

        def __init__(self, config, *, tag):
            super().__init__()
            self.tag, self.calls = tag, []
            Recording.made.append(self)

        def start_engine(self, config, index, log_path):
            self.calls.append(("engine", index, log_path.name))
            return super().start_engine(config, index, log_path)

        def close(self):
            self.calls.append(("close",))
            super().close()
    """
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"launcher": "no_colon"}, "launcher must be a dotted path pkg.module:factory"),
        ({"launcher_args": {"a": 1}}, "launcher_args is for a launcher: set launcher too"),
    ],
)
def test_config_checks_the_launcher(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetConfig(model_path="/m", **kwargs)


def test_the_default_launcher_starts_an_engine_here(tmp_path: Path) -> None:
    config = FleetConfig(
        model_path="/m", backend="command", command=[sys.executable, "-c", _SERVER, "{port}"]
    )
    launcher = make_launcher(config)
    assert isinstance(launcher, LocalLauncher)
    child, command, host = launcher.start_engine(config, 0, tmp_path / "engine-0.log")
    try:
        url = wait_healthy(child, command, host, time.monotonic() + 60)
        assert url == f"http://127.0.0.1:{command.port}"
        assert f"listening on {command.port}".encode() in child.read_log()
    finally:
        child.stop(5)
        launcher.close()
    assert wait_gone([child.pid], 10) == []


def test_a_named_launcher_runs_the_fleet_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet starts its engines through the named launcher and closes it when start-up
    fails (here: SGLang is not installed, so its engine exits at import)."""
    try:
        find_router()
    except FileNotFoundError:
        pytest.skip("sglang-router is not installed")
    (tmp_path / "my_launcher.py").write_text(_RECORDING)
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = FleetConfig(model_path="/m", launcher="my_launcher:Nope")
    with pytest.raises(ValueError, match="my_launcher has no callable 'Nope'"):
        make_launcher(missing)
    fleet = FleetConfig(
        model_path=str(tmp_path),
        backend="sglang",
        sglang_python=sys.executable,
        log_dir=str(tmp_path / "logs"),
        launcher="my_launcher:Recording",
        launcher_args={"tag": "t1"},
    ).build()
    with pytest.raises(StartupError, match="No module named 'sglang'"):
        fleet.start()
    recording = sys.modules["my_launcher"].Recording.made
    assert len(recording) == 1
    assert recording[0].tag == "t1"
    assert recording[0].calls == [("engine", 0, "engine-0.log"), ("close",)]
