"""The fleet's parts without engines: config checks, command lines, start-up waits.

The waits run against real child processes (small Python HTTP servers and programs that fail),
started by the fleet's own spawner; nothing here loads a model.
"""

from __future__ import annotations

import socket
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_rollout.cli import _parser
from miles_rollout.fleet import FleetConfig, StartupError
from miles_rollout.fleet.engines import EngineCommand, engine_command, wait_healthy
from miles_rollout.fleet.processes import Spawner, wait_gone
from miles_rollout.fleet.router import ROUTER_DEFAULTS, find_router, parse_prometheus, router_argv
from miles_rollout.fleet.sglang import gpus_per_engine, parse_passthrough, sglang_argv


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"engines": 0}, "engines"),
        ({"dp_size": 0}, "dp_size"),
        ({"backend": "vllm"}, "backend"),
        ({"router_port": 70000}, "router_port"),
        ({"sglang_args": {"tp_size": 2}}, "sglang_args"),
        ({"backend": "sglang", "sglang_args": {"port": 1}}, "FleetConfig.port"),
        ({"backend": "sglang", "sglang_args": {"dp-size": 2}}, "FleetConfig.dp_size"),
        ({"engine_args": {"model_path": "x"}}, "FleetConfig.model_path"),
        ({"backend": "command"}, "{port}"),
        ({"backend": "command", "command": ["srv", "--port", "8000"]}, "{port}"),
        ({"command": ["srv", "{port}"]}, "command"),
        ({"router_args": {"worker_urls": ["x"]}}, "router_args"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
        ({"host": "0.0.0.0"}, "--insecure-no-auth"),
        ({"engine_args": {"api_key": "k"}}, "FleetConfig.api_key"),
        ({"router_args": {"api-key": "k"}}, "FleetConfig.api_key"),
        ({"api_key": "has space"}, "printable ASCII"),
    ],
)
def test_config_rejects_mistakes_naming_the_field(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("{", r"\{").replace("}", r"\}")):
        FleetConfig(model_path="/m", **kwargs)


def test_sglang_command_line_passes_flags_through() -> None:
    argv = sglang_argv(
        index=0,
        model_path="/ckpt",
        host="127.0.0.1",
        port=31000,
        dp_size=2,
        sglang_args={"tp_size": 2, "enable_dp_attention": True, "skip": False},
        python="/opt/py",
    )
    assert argv == [
        "/opt/py", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host",
        "127.0.0.1", "--port", "31000", "--dp-size", "2", "--tp-size", "2",
        "--enable-dp-attention",
    ]  # fmt: skip
    # Engine 3 of tp 2 x dp 2 without DP attention starts on GPU 12; with it, on GPU 6.
    assert sglang_argv(
        index=3, model_path="/c", host="h", port=1, dp_size=2, sglang_args={"tp_size": 2}
    )[-2:] == ["--base-gpu-id", "12"]
    assert gpus_per_engine({"tp_size": 2, "enable_dp_attention": True}, 2) == 2
    explicit = sglang_argv(
        index=3, model_path="/c", host="h", port=1, dp_size=1, sglang_args={"base_gpu_id": 0}
    )
    assert explicit[-2:] == ["--base-gpu-id", "0"]
    assert (
        sglang_argv(index=0, model_path="/c", host="h", port=1, dp_size=1, sglang_args={})[0]
        == sys.executable
    )


def test_passthrough_flags_from_the_command_line() -> None:
    tokens = ["--sglang-tp-size", "2", "--sglang-enable-dp-attention", "--sglang-x=y"]
    tokens += ["--sglang-cuda-graph-bs", "1", "2", "4"]
    assert parse_passthrough(tokens, "sglang-") == {
        "tp_size": "2",
        "enable_dp_attention": True,
        "x": "y",
        "cuda_graph_bs": ["1", "2", "4"],
    }
    with pytest.raises(ValueError, match="--sglang-NAME"):
        parse_passthrough(["--tp-size", "2"], "sglang-")
    with pytest.raises(ValueError, match="unrecognized argument '2'"):
        parse_passthrough(["2"], "sglang-")


def test_cli_parses_fleet_with_passthrough() -> None:
    args, extra = _parser().parse_known_args(
        ["fleet", "--model-path", "/m", "--engines", "3", "--backend", "sglang",
         "--sglang-tp-size", "2", "--router-arg", "policy=round_robin", "--command", "x {port}"]
    )  # fmt: skip
    assert (args.command, args.engines, args.backend) == ("fleet", 3, "sglang")
    assert args.engine_command == "x {port}"
    assert args.router_arg == ["policy=round_robin"]
    assert extra == ["--sglang-tp-size", "2"]


def test_engine_command_per_backend(tmp_path: Path) -> None:
    embedded = engine_command(
        FleetConfig(model_path="/m", dp_size=2, engine_args={"num_threads": 1, "seed": 5}), 1
    )
    assert embedded.port == 0  # it binds port 0 and prints its URL
    assert embedded.argv[1:4] == ["-m", "miles_rollout.cli", "serve"]
    assert embedded.argv[-8:] == [
        "--port", "0", "--dp-size", "2", "--num-threads", "1", "--seed", "6",
    ]  # fmt: skip
    cmd = engine_command(
        FleetConfig(
            model_path="/m", backend="command", command=["srv", "{host}:{port}", "{index}"]
        ),
        4,
    )
    assert cmd.argv == ["srv", f"127.0.0.1:{cmd.port}", "4"]
    assert cmd.port > 0
    sgl = engine_command(FleetConfig(model_path="/m", backend="sglang", sglang_python="/p"), 0)
    assert sgl.argv[:3] == ["/p", "-m", "sglang.launch_server"]
    assert sgl.argv[sgl.argv.index("--port") + 1] == str(sgl.port)


def test_the_api_key_reaches_engines_and_router(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_rollout.fleet.engines import engine_env

    monkeypatch.setenv("MILES_API_KEY", "inherited")
    keyed = FleetConfig(model_path="/m", api_key="k1", engine_env={"X": "1"})
    env = engine_env(keyed)
    assert (env["MILES_API_KEY"], env["X"]) == ("k1", "1")
    assert "k1" not in engine_command(keyed, 0).argv  # not on a command line ps shows
    # No key for the fleet: none inherited either (it would lock the router out).
    assert "MILES_API_KEY" not in engine_env(FleetConfig(model_path="/m"))
    sgl = engine_command(FleetConfig(model_path="/m", backend="sglang", api_key="k2"), 0)
    assert sgl.argv[sgl.argv.index("--api-key") + 1] == "k2"  # SGLang's own flag
    argv = router_argv(
        "r", ["http://a:1"], host="h", port=1, prometheus_port=2, router_args={}, api_key="k3"
    )
    assert argv[argv.index("--api-key") + 1] == "k3"
    public = FleetConfig(model_path="/m", host="0.0.0.0", insecure_no_auth=True)
    assert "--insecure-no-auth" in engine_command(public, 0).argv


def test_router_command_line_defaults_and_overrides() -> None:
    argv = router_argv(
        "sglang-router",
        ["http://a:1", "http://b:2"],
        host="127.0.0.1",
        port=30000,
        prometheus_port=30001,
        router_args={"policy": "round_robin", "dp-aware": False, "retry_max_retries": 1},
    )
    assert argv[:5] == ["sglang-router", "launch", "--worker-urls", "http://a:1", "http://b:2"]
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 30000" in joined
    assert "--prometheus-host 127.0.0.1 --prometheus-port 30001" in joined
    assert "--policy round_robin" in joined
    assert "--dp-aware" not in joined
    assert "--assignment-mode min_load" in joined
    assert "--retry-max-retries 1" in joined
    assert ROUTER_DEFAULTS["dp_aware"] is True


def test_prometheus_text_parsing() -> None:
    text = textwrap.dedent(
        """\
        # HELP smg_manual_policy_branch_total Routing decisions
        # TYPE smg_manual_policy_branch_total counter
        smg_manual_policy_branch_total{branch="occupied_miss"} 2
        smg_manual_policy_branch_total{branch="vacant"} 4
        smg_worker_health{worker="http://127.0.0.1:1@0",x="a\\"b"} 1
        smg_http_connections_active 0
        """
    )
    assert parse_prometheus(text) == [
        ("smg_manual_policy_branch_total", {"branch": "occupied_miss"}, 2.0),
        ("smg_manual_policy_branch_total", {"branch": "vacant"}, 4.0),
        ("smg_worker_health", {"worker": "http://127.0.0.1:1@0", "x": 'a\\"b'}, 1.0),
        ("smg_http_connections_active", {}, 0.0),
    ]


def test_router_lookup_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_SGLANG_ROUTER", "/nonexistent/sglang-router")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_router()


# A server that answers /health with 503 twice (SGLang does while it loads), then 200. It binds
# port 0 and prints its URL (split so that this code, which the log also holds, does not match).
_SLOW_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
seen = []
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        seen.append(self.path)
        code = 503 if self.path == "/health" and seen.count("/health") <= 2 else 200
        self.send_response(code); self.end_headers()
    def log_message(self, *a):
        print(self.requestline, self.path, flush=True)
server = HTTPServer(("127.0.0.1", 0), H)
print("serving at", "http://127.0.0.1:%d" % server.server_port, flush=True)
server.serve_forever()
"""


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections while the test runs (bound, not listening:
    nobody else can take it, unlike a number picked and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def test_health_wait_rides_out_503_then_succeeds(tmp_path: Path) -> None:
    spawner = Spawner()
    child = spawner.spawn("engine 0", [sys.executable, "-c", _SLOW_SERVER], tmp_path / "e.log")
    try:
        # Port 0: the server binds its own port and announces the URL, as engines do.
        url = wait_healthy(child, EngineCommand([], 0), "127.0.0.1", time.monotonic() + 60)
        assert url.startswith("http://127.0.0.1:")
        assert f"serving at {url}" in child.log_tail()
        assert child.log_tail().count("GET /health") == 3  # 503, 503, 200
    finally:
        child.stop(5)
        spawner.close()
    assert wait_gone([child.pid], 10) == []


def test_health_wait_reports_an_engine_that_exits(tmp_path: Path, refusing_port: int) -> None:
    spawner = Spawner()
    code = "import sys; print('no CUDA device found'); sys.exit(3)"
    child = spawner.spawn("engine 0", [sys.executable, "-c", code], tmp_path / "e.log")
    try:
        with pytest.raises(StartupError, match=r"engine 0 exited with status 3(.|\n)*no CUDA"):
            wait_healthy(
                child, EngineCommand([], refusing_port), "127.0.0.1", time.monotonic() + 60
            )
    finally:
        spawner.close()


def test_health_wait_times_out_with_the_log(tmp_path: Path, refusing_port: int) -> None:
    spawner = Spawner()
    code = "import time; print('loading shards', flush=True); time.sleep(60)"
    child = spawner.spawn("engine 0", [sys.executable, "-c", code], tmp_path / "e.log")
    try:
        with pytest.raises(StartupError, match=r"did not get to a healthy(.|\n)*loading shards"):
            wait_healthy(child, EngineCommand([], refusing_port), "127.0.0.1", time.monotonic() + 2)
    finally:
        child.stop(5)
        spawner.close()
    assert wait_gone([child.pid], 10) == []


def test_sglang_backend_without_sglang_fails_cleanly(tmp_path: Path) -> None:
    """SGLang is not installed here: the engine exits at import and start() says so, leaving
    no process behind (the real launcher, not a stand-in)."""
    try:
        find_router()
    except FileNotFoundError:
        pytest.skip("sglang-router is not installed")
    try:
        import sglang  # noqa: F401

        pytest.skip("SGLang is installed here; the GPU check covers it")
    except ImportError:
        pass
    fleet = FleetConfig(
        model_path=str(tmp_path), backend="sglang", log_dir=str(tmp_path / "logs")
    ).build()
    with pytest.raises(StartupError, match="No module named 'sglang'"):
        fleet.start()
    assert fleet.router is None
    assert fleet.engines == []
    log = (tmp_path / "logs" / "engine-0.log").read_text()
    assert f"-m sglang.launch_server --model-path {tmp_path} --host 127.0.0.1 --port" in log


def test_health_wait_stops_when_cancelled(tmp_path: Path, refusing_port: int) -> None:
    """Closing the fleet cancels a replacement that is still loading."""
    spawner = Spawner()
    child = spawner.spawn(
        "engine 2", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "e.log"
    )
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    try:
        with pytest.raises(StartupError, match="cancelled while waiting for engine 2"):
            wait_healthy(
                child, EngineCommand([], refusing_port), "127.0.0.1", time.monotonic() + 60, cancel
            )
    finally:
        child.stop(5)
        spawner.close()
