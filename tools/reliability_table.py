"""Regenerate docs/reliability.md: every fault and bad input of issue 31, performed for real.

Each row runs the installed console scripts (``miles``, ``miles-rollout``, ``miles-transfer``,
``miles-quant-checkpoint``, ``miles-env``) or a real server (the engine server, the TITO session
server, miles-transfer's WeightServer, the keyed P2P mesh) in child processes, does the fault
(a request without the API key, a damaged file, a killed engine, a full disk, a hung reward...),
and records what the user saw (exit code and the error line, or HTTP status and body) and
whether anything was lost or half-applied, checked after the fact (file digests, the server
still answering, the run's own rows).

Run it (a few minutes on 2 CPU cores; builds the tiny demo model unless ``--model`` is given)::

    python tools/reliability_table.py                      # writes docs/reliability.md
    python tools/reliability_table.py --only yaml,busy-port --out /tmp/r.md --json /tmp/r.json

Rows come from the same code on any machine; the full disk needs root for a private tmpfs
(``unshare -m`` + ``mount -t tmpfs -o size=8m``) and falls back to ``RLIMIT_FSIZE`` otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KEY = "reliability-key"
GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
# Import-time warnings of third-party libraries (torchao's optional kernels, torch's pytree
# deprecation): not our error line; counted apart so the table shows them without hiding ours.
NOISE = ("Failed to load /", "torch/utils/_pytree.py", "register_constant()")


@dataclass(kw_only=True, slots=True)
class Row:
    """One fault, what the user saw, and what was checked afterwards.

    Attributes:
        key: the row's name for ``--only``.
        fault: the fault or bad input, in words.
        tried: the command or request, in words.
        exit_code: the command's exit status (``None`` for HTTP rows).
        status: the HTTP status (``None`` for command rows).
        saw: the error line (commands) or the body excerpt (HTTP).
        stderr_lines: non-empty stderr lines besides import noise (1 = one clean line).
        noise_lines: third-party import warnings on stderr.
        traceback: whether stderr held a Python traceback.
        intact: whether nothing was lost or half-applied (``None``: not applicable).
        checked: what was checked to say so.
        holds: whether the row behaves as issue 31 asks.
        note: anything that does not hold, or how the fault was made.
    """

    key: str
    fault: str
    tried: str
    exit_code: int | None = None
    status: int | None = None
    saw: str = ""
    stderr_lines: int = 0
    noise_lines: int = 0
    traceback: bool = False
    intact: bool | None = None
    checked: str = ""
    holds: bool = False
    note: str = ""
    seconds: float = 0.0


@dataclass(kw_only=True)
class Ctx:
    """Shared state of one table run: the work directory, the model, the servers started."""

    work: Path
    model: Path
    timeout: float = 300.0
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def dir(self, name: str) -> Path:
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        return d


# ---- helpers ----------------------------------------------------------------------------------


SCRIPTS = {
    "miles": "miles",
    "miles-rollout": "miles_rollout.cli",
    "miles-transfer": "miles_transfer.cli",
    "miles-quant-checkpoint": "miles_quant.checkpoint_cli",
    "miles-env": "miles_env.cli",
}


def script(name: str) -> list[str]:
    """The installed console script ``name`` (or ``python -m`` its module where the
    environment has no scripts directory, as in a Pants sandbox)."""
    path = BIN / name
    return [str(path)] if path.is_file() else [sys.executable, "-m", SCRIPTS[name]]


def digest_tree(path: Path) -> dict[str, str]:
    """``{relative path: blake2b}`` of every file under ``path`` (empty if it does not exist)."""
    if path.is_file():
        return {path.name: hashlib.blake2b(path.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(path.rglob("*")) if path.exists() else []:
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.blake2b(p.read_bytes()).hexdigest()
    return out


@dataclass(kw_only=True, slots=True)
class Ran:
    rc: int
    out: str
    err: str


def run_cmd(ctx: Ctx, argv: list[str], *, cwd: Path | None = None, timeout: float | None = None,
            env: dict[str, str] | None = None) -> Ran:  # fmt: skip
    """Run a command to completion (killed past the timeout: rc -9)."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd or ctx.work,
        env=env or ctx.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout or ctx.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return Ran(rc=proc.returncode, out=out, err=err)


def fill_from_stderr(row: Row, ran: Ran) -> None:
    """Exit code, the first line that is not import noise, and the line counts."""
    lines = [line for line in ran.err.splitlines() if line.strip()]
    noise = [line for line in lines if any(n in line for n in NOISE)]
    ours = [line for line in lines if line not in noise]
    row.exit_code = ran.rc
    row.noise_lines = len(noise)
    row.stderr_lines = len(ours)
    row.traceback = "Traceback (most recent call last)" in ran.err
    errors = [line for line in ours if ": error: " in line or ": stopped: " in line]
    if row.traceback:
        last = [line for line in ours if not line.startswith((" ", "[rank0]:  "))]
        row.saw = last[-1] if last else ""
    else:
        row.saw = (errors or ours or [""])[0]


def one_line_error(row: Row, ran: Ran, *, intact: bool, checked: str) -> Row:
    """The usual verdict for a bad input: exit 2, one line, no traceback, nothing changed."""
    fill_from_stderr(row, ran)
    row.intact = intact
    row.checked = checked
    row.holds = ran.rc == 2 and row.stderr_lines == 1 and not row.traceback and intact
    return row


def http(method: str, url: str, body: Any = None, *, key: str | None = None,
         timeout: float = 120.0) -> tuple[int, dict[str, str], str]:  # fmt: skip
    """One request; returns (status, headers, body text)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def excerpt(text: str, n: int = 110) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def start_server(ctx: Ctx, argv: list[str], marker: str, name: str) -> str:
    """Start a server process, return the URL it prints after ``marker``; stopped at the end."""
    log = open(ctx.work / f"{name}.err", "w")  # noqa: SIM115 (closed by the cleanup)
    proc = subprocess.Popen(
        argv,
        cwd=ctx.work,
        env=ctx.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()

    ctx.cleanup.append(stop)
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if marker in line and not found:
                found.append(line.rsplit(" at ", 1)[1].strip())
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(ctx.timeout)
    if not found:
        raise RuntimeError(
            f"{name} did not start: {(ctx.work / f'{name}.err').read_text()[-2000:]}"
        )
    return found[0]


def driver(ctx: Ctx, name: str, *args: str, timeout: float | None = None) -> dict[str, Any]:
    """Run one of this file's ``--driver`` functions in a child process; its JSON answer."""
    ran = run_cmd(ctx, [sys.executable, __file__, "--driver", name, *args], timeout=timeout)
    lines = [line for line in ran.out.splitlines() if line.startswith("{")]
    if ran.rc != 0 or not lines:
        raise RuntimeError(f"driver {name} failed (rc {ran.rc}): {ran.err[-3000:]}")
    return json.loads(lines[-1])


def engine_server(ctx: Ctx) -> str:
    """One keyed ``miles-rollout serve`` (1 running request, 1 queued) for the server rows."""
    if "engine" not in ctx.cache:
        argv = [*script("miles-rollout"), "serve", "--model-path", str(ctx.model)]
        argv += ["--port", "0", "--api-key", KEY, "--max-running-requests", "1"]
        argv += ["--max-queued-requests", "1"]
        ctx.cache["engine"] = start_server(ctx, argv, "miles-rollout serving", "engine")
    return str(ctx.cache["engine"])


def damaged_model(ctx: Ctx, kind: str) -> Path:
    out = ctx.work / f"damaged-{kind}"
    if not out.exists():
        shutil.copytree(ctx.model, out)
        if kind == "config":
            (out / "config.json").write_text('{"model_type": "qwen3", ')
        elif kind == "weights":
            (out / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{oops")
        elif kind == "no-weight-map":
            (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    return out


def miles_train(ctx: Ctx, out: Path, *sets: str, steps: int = 1) -> list[str]:
    argv = [*script("miles"), "train", "arith-tiny", "--steps", str(steps), "--out", str(out)]
    argv += ["--no-progress", "--set", f"model_path={ctx.model}"]
    for s in sets:
        argv += ["--set", s]
    return argv


def metrics_rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- rows: authentication ---------------------------------------------------------------------


def row_unauthenticated_engine(ctx: Ctx) -> Row:
    row = Row(
        key="unauthenticated-engine",
        fault="control request without the API key: engine server",
        tried="`miles-rollout serve --api-key K`; POST /update_weight_version "
        '{"new_version": "evil"} with no Authorization header',
    )
    url = engine_server(ctx)
    row.status, _, body = http("POST", url + "/update_weight_version", {"new_version": "evil"})
    row.saw = excerpt(body)
    _, _, info = http("GET", url + "/get_server_info", key=KEY)
    version = json.loads(info)["internal_states"][0].get("weight_version")
    version = version if version is not None else json.loads(info).get("weight_version")
    gen_status, _, _ = http("POST", url + "/generate", GEN, key=KEY)
    row.intact = str(version) == "0" and gen_status == 200
    row.checked = f"weight_version still {version!r}; /generate with the key: {gen_status}"
    row.holds = row.status == 401 and bool(row.intact)
    return row


def row_unauthenticated_sessions(ctx: Ctx) -> Row:
    row = Row(
        key="unauthenticated-sessions",
        fault="control request without the API key: TITO session server",
        tried="`miles-rollout sessions --api-key K`; POST /sessions with no Authorization",
    )
    argv = [*script("miles-rollout"), "sessions", "--engine-url", engine_server(ctx)]
    argv += ["--model-path", str(ctx.model), "--api-key", KEY, "--port", "0"]
    url = start_server(ctx, argv, "miles-rollout sessions", "sessions")
    row.status, _, body = http("POST", url + "/sessions", {})
    row.saw = excerpt(body)
    ok_status, _, created = http("POST", url + "/sessions", {}, key=KEY)
    row.intact = ok_status == 200
    row.checked = f"the same POST with the key: {ok_status} ({excerpt(created, 60)})"
    row.holds = row.status == 401 and row.intact
    return row


def row_unauthenticated_weight_server(ctx: Ctx) -> Row:
    row = Row(
        key="unauthenticated-weight-server",
        fault="control request without the API key: miles-transfer WeightServer",
        tried="WeightServer(api_key=K) in its own process; POST /update_weights_from_disk "
        "(a checkpoint of other weights) with no Authorization",
    )
    ans = driver(ctx, "weight-server", str(ctx.dir("weight-server")))
    row.status = ans["status"]
    row.saw = excerpt(ans["body"])
    row.intact = ans["checksum_before"] == ans["checksum_after"] and ans["keyed_status"] == 200
    row.checked = (
        "weights checksum unchanged; the same update with the key: "
        f"{ans['keyed_status']}, checksum changed: {ans['keyed_changed']}"
    )
    row.holds = row.status == 401 and row.intact and ans["keyed_changed"]
    return row


def row_unauthenticated_p2p(ctx: Ctx) -> Row:
    row = Row(
        key="unauthenticated-p2p",
        fault="P2P mesh connection without the key",
        tried="keyed TcpTransport receiver; a raw TCP peer sends the unkeyed 8-byte hello and "
        "shard bytes; then a peer with another key",
    )
    ans = driver(ctx, "p2p")
    row.saw = ans["saw"]
    row.intact = ans["no_connection"] and ans["keyed_ok"]
    row.checked = (
        f"receiver holds no connection from the intruder: {ans['no_connection']}; a keyed "
        f"send afterwards arrives bit for bit: {ans['keyed_ok']}"
    )
    row.holds = ans["closed"] and ans["wrong_key_refused"] and bool(row.intact)
    return row


# ---- rows: bad input to the commands ----------------------------------------------------------


def row_yaml(ctx: Ctx) -> Row:
    row = Row(
        key="yaml",
        fault="a --set value that is not YAML",
        tried="`miles train arith-tiny --set 'trainer.lr=['`",
    )
    out = ctx.work / "yaml-run"
    ran = run_cmd(ctx, [*script("miles"), "train", "arith-tiny", "--set", "trainer.lr=[",
                        "--out", str(out)])  # fmt: skip
    return one_line_error(row, ran, intact=not out.exists(), checked="no run directory created")


def row_engine_url(ctx: Ctx) -> Row:
    row = Row(
        key="engine-url",
        fault="an unreachable rollout.engine_url",
        tried="`miles train ... --set rollout.engine_url=http://127.0.0.1:PORT` (bound, not "
        "listening)",
    )
    out = ctx.work / "engine-url-run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        ran = run_cmd(ctx, miles_train(ctx, out, f"rollout.engine_url={url}"))
    return one_line_error(row, ran, intact=not out.exists(), checked="no run directory created")


def _damaged_train(ctx: Ctx, key: str, kind: str, fault: str) -> Row:
    row = Row(key=key, fault=fault, tried=f"`miles train arith-tiny --set model_path=<{fault}>`")
    model = damaged_model(ctx, kind)
    before = digest_tree(model)
    out = ctx.work / f"{key}-run"
    argv = [*script("miles"), "train", "arith-tiny", "--out", str(out), "--no-progress"]
    ran = run_cmd(ctx, [*argv, "--set", f"model_path={model}"])
    intact = not out.exists() and digest_tree(model) == before
    return one_line_error(row, ran, intact=intact, checked="no run directory; the model unchanged")


def row_corrupt_config(ctx: Ctx) -> Row:
    return _damaged_train(ctx, "corrupt-config", "config", "a corrupt config.json")


def row_corrupt_weights(ctx: Ctx) -> Row:
    return _damaged_train(ctx, "corrupt-weights", "weights", "a corrupt model.safetensors")


def row_recipe_raises(ctx: Ctx) -> Row:
    row = Row(
        key="recipe-raises",
        fault="a Python recipe raising in recipe()",
        tried="`miles train my_recipe.py` whose recipe() raises KeyError",
    )
    recipe = ctx.dir("recipe") / "my_recipe.py"
    recipe.write_text("def recipe():\n    return {'model_path': {}['model_path']}\n")
    ran = run_cmd(ctx, [*script("miles"), "train", str(recipe)], cwd=recipe.parent)
    intact = not (recipe.parent / "runs").exists()
    return one_line_error(row, ran, intact=intact, checked="no run directory created")


def row_busy_port(ctx: Ctx) -> Row:
    row = Row(
        key="busy-port",
        fault="`miles-rollout serve` on a busy port",
        tried="`miles-rollout serve --port P` while another socket listens on P",
    )
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        argv = [*script("miles-rollout"), "serve", "--model-path", str(ctx.model)]
        ran = run_cmd(ctx, [*argv, "--port", str(port)])
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            still = True  # the listener that held the port still accepts
    return one_line_error(row, ran, intact=still, checked="the port's owner still accepts")


def _delta_inputs(ctx: Ctx) -> tuple[Path, Path]:
    """(a target checkpoint, a delta to it from a perturbed copy) made by the real CLI."""
    root = ctx.dir("delta")
    base, new, d = root / "base", root / "new", root / "d"
    if not d.exists():
        shutil.copytree(ctx.model, base)
        shutil.copytree(ctx.model, new)
        ran = run_cmd(ctx, [sys.executable, __file__, "--driver", "perturb", str(new)])
        assert ran.rc == 0, ran.err
        argv = [*script("miles-transfer"), "delta", "encode", "--base", str(base)]
        ran = run_cmd(ctx, [*argv, "--new", str(new), "--out", str(d)])
        assert ran.rc == 0, ran.err
    return base, d


def row_delta_null_chunk(ctx: Ctx) -> Row:
    row = Row(
        key="delta-null-chunk",
        fault="a delta manifest with a null chunk index",
        tried="`miles-transfer delta apply --target CKPT --delta D` with delta.json's first "
        "chunk index set to null",
    )
    base, d = _delta_inputs(ctx)
    manifest = json.loads((d / "delta.json").read_text())
    entry = next(t for t in manifest["tensors"].values() if t["chunks"])
    entry["chunks"][0][0] = None
    (d / "delta.json").write_text(json.dumps(manifest))
    before = digest_tree(base)
    argv = [*script("miles-transfer"), "delta", "apply", "--target", str(base)]
    ran = run_cmd(ctx, [*argv, "--delta", str(d)])
    intact = digest_tree(base) == before
    return one_line_error(row, ran, intact=intact, checked="target checkpoint bytes unchanged")


def _quant(ctx: Ctx, key: str, kind: str, fault: str) -> Row:
    row = Row(key=key, fault=fault, tried=f"`miles-quant-checkpoint SRC DST -f fp8_block128` on "
              f"{fault}")  # fmt: skip
    src = damaged_model(ctx, kind)
    before = digest_tree(src)
    dst = ctx.work / f"{key}-out"
    argv = [*script("miles-quant-checkpoint"), str(src), str(dst), "-f", "fp8_block128"]
    ran = run_cmd(ctx, [*argv, "--no-progress"])
    intact = not dst.exists() and digest_tree(src) == before
    return one_line_error(row, ran, intact=intact, checked="no output directory; source unchanged")


def row_quant_corrupt(ctx: Ctx) -> Row:
    return _quant(ctx, "quant-corrupt", "weights", "a corrupt safetensors")


def row_quant_no_weight_map(ctx: Ctx) -> Row:
    return _quant(ctx, "quant-no-weight-map", "no-weight-map", "an index without weight_map")


def row_env_missing(ctx: Ctx) -> Row:
    row = Row(
        key="env-missing-dir",
        fault="`miles-env check` on a missing task directory",
        tried="`miles-env check ./no-tasks-here`",
    )
    ran = run_cmd(ctx, [*script("miles-env"), "check", str(ctx.work / "no-tasks-here")])
    intact = not (ctx.work / "no-tasks-here").exists()
    return one_line_error(row, ran, intact=intact, checked="nothing created")


def row_offload_manifest(ctx: Ctx) -> Row:
    row = Row(
        key="offload-manifest",
        fault="an offload manifest.json of the wrong shape",
        tried="`miles_offload.AdamW(..., offload='nvme', resume=True)` over committed state "
        "whose manifest.json is a JSON list",
    )
    ans = driver(ctx, "offload", str(ctx.dir("offload-manifest")), "manifest")
    row.saw = ans["error"]
    row.stderr_lines = 1
    row.intact = ans["unchanged"] and ans["params_untouched"]
    row.checked = "state files unchanged; the new parameters untouched"
    row.holds = ans["type"] == "CorruptStateError" and "manifest.json" in ans["error"]
    row.holds = row.holds and row.intact
    return row


def row_adamw_resume_false(ctx: Ctx) -> Row:
    row = Row(
        key="adamw-resume-false",
        fault="AdamW resume=False over committed state",
        tried="`miles_offload.AdamW(..., offload='nvme', resume=False)` on a directory holding "
        "two committed steps",
    )
    ans = driver(ctx, "offload", str(ctx.dir("offload-resume")), "resume-false")
    row.saw = ans["error"]
    row.stderr_lines = 1
    row.intact = ans["unchanged"]
    row.checked = f"state files unchanged; resume=True afterwards loads them: {ans['resumes']}"
    row.holds = ans["type"] == "ValueError" and bool(row.intact) and ans["resumes"]
    return row


# ---- rows: bounds of the engine server --------------------------------------------------------


def row_big_body(ctx: Ctx) -> Row:
    row = Row(
        key="big-body",
        fault="a 1 GiB request body to the engine server",
        tried="POST /generate with the key and Content-Length: 1 GiB, body streamed until the "
        "server answers",
    )
    url = engine_server(ctx)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=60) as s:
        head = (
            f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n"
        )
        s.sendall(head.encode())
        chunk = b"x" * (1 << 20)
        s.settimeout(0.2)
        answer = b""
        while sent < 1 << 30:
            try:
                answer = s.recv(65536)
                if answer:
                    break
            except TimeoutError:
                pass
            try:
                s.sendall(chunk)
                sent += len(chunk)
            except OSError:
                break
        s.settimeout(30)
        while b"\r\n\r\n" not in answer:
            more = s.recv(65536)
            if not more:
                break
            answer += more
    status_line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    row.status = int(status_line.split()[1]) if len(status_line.split()) > 1 else None
    body = answer.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")
    row.saw = excerpt(body)
    gen_status, _, _ = http("POST", url + "/generate", GEN, key=KEY)
    row.intact = gen_status == 200
    row.checked = f"answered after {sent >> 20} MiB sent; /generate afterwards: {gen_status}"
    row.holds = row.status == 413 and row.intact
    return row


def row_queue_full(ctx: Ctx) -> Row:
    row = Row(
        key="queue-full",
        fault="engine server queue full",
        tried="8 concurrent POST /generate (100 tokens each) to `serve --max-running-requests 1 "
        "--max-queued-requests 1`",
    )
    url = engine_server(ctx)
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True},
    }
    results: list[tuple[int, dict[str, str], str]] = []
    lock = threading.Lock()

    def one() -> None:
        r = http("POST", url + "/generate", body, key=KEY, timeout=300)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if r[0] == 503]
    served = [r for r in results if r[0] == 200]
    full = all(len(json.loads(r[2])["output_ids"]) == 100 for r in served)
    if refused:
        row.status = 503
        row.saw = f"Retry-After: {refused[0][1].get('Retry-After')}; " + excerpt(refused[0][2], 80)
    row.intact = full and len(served) + len(refused) == 8
    row.checked = f"{len(served)} served in full (100 tokens), {len(refused)} refused, none lost"
    row.holds = bool(refused) and bool(served) and row.intact and "Retry-After" in refused[0][1]
    return row


# ---- rows: faults during a run ----------------------------------------------------------------


def _engine_pids(parent: int) -> list[int]:
    """``miles-rollout serve`` processes whose parent is ``parent``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and "serve" in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def row_killed_engine(ctx: Ctx) -> Row:
    steps = 6
    row = Row(
        key="killed-engine",
        fault="an engine killed during a run",
        tried=f"`miles train arith-tiny --steps {steps} --set 'fleet={{engines: 2}}'` (async, "
        "sglang-router); SIGKILL one engine after step 1",
    )
    run = ctx.work / "killed-engine-run"
    argv = miles_train(ctx, run, "fleet={engines: 2}", "rollout.mode=async",
                       "rollout.max_staleness=8", "rollout.prompts_per_step=4",
                       "rollout.n_samples_per_prompt=4", steps=steps)  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ctx.work, env=ctx.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    killed_at = None
    try:
        deadline = time.monotonic() + ctx.timeout
        while not metrics_rows(run) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        engines = _engine_pids(proc.pid)
        if engines:
            os.kill(engines[0], signal.SIGKILL)
            killed_at = len(metrics_rows(run))
        out, err = proc.communicate(timeout=ctx.timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    fill_from_stderr(row, Ran(rc=proc.returncode, out=out, err=err))
    rows = metrics_rows(run)
    deaths = rows[-1].get("fleet/engine_deaths") if rows else None
    row.saw = f"the run went on; fleet/engine_deaths={deaths} in the last row"
    complete = [r["step"] for r in rows] == list(range(1, steps + 1))
    verified = all(r.get("update/verified") for r in rows)
    row.intact = complete and verified and not _engine_pids(proc.pid)
    row.checked = (
        f"killed after {killed_at} step(s); all {steps} steps trained: {complete}; every update "
        f"verified: {verified}; no engine left behind"
    )
    killed_mid_run = killed_at is not None and killed_at < steps
    row.holds = proc.returncode == 0 and bool(row.intact) and deaths == 1 and killed_mid_run
    return row


_FULL_DISK_INNER = """
set -u
mount -t tmpfs -o size=8m tmpfs "$MNT" || exit 90
"$@"
rc=$?
cp -a "$MNT/run" "$COPY" 2>/dev/null
exit $rc
"""


def row_full_disk(ctx: Ctx) -> Row:
    row = Row(
        key="full-disk",
        fault="a full disk during a checkpoint",
        tried="`miles train --steps 3 --set run.save_every=1` with --out on an 8 MiB tmpfs "
        "(a private mount namespace; one checkpoint is ~5 MB)",
    )
    root = ctx.dir("full-disk")
    mnt, copy = root / "mnt", root / "copy"
    mnt.mkdir(exist_ok=True)
    argv = miles_train(ctx, mnt / "run", "run.save_every=1", "rollout.prompts_per_step=2",
                       "rollout.n_samples_per_prompt=2", steps=3)  # fmt: skip
    env = ctx.env(MNT=str(mnt), COPY=str(copy))
    ran = run_cmd(ctx, ["unshare", "-m", "sh", "-c", _FULL_DISK_INNER, "sh", *argv], env=env)
    how = "tmpfs size=8m in `unshare -m`"
    if ran.rc == 90 or not shutil.which("unshare"):
        # No private tmpfs (not root): the file size limit makes writes past 8 MB fail (EFBIG).
        how = "RLIMIT_FSIZE 8 MB (no tmpfs without root)"
        run_dir = root / "run"

        def limit() -> None:
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

        argv = miles_train(ctx, run_dir, "run.save_every=1", "rollout.prompts_per_step=2",
                           "rollout.n_samples_per_prompt=2", steps=3)  # fmt: skip
        proc = subprocess.run(argv, cwd=ctx.work, env=ctx.env(), capture_output=True, text=True,
                              preexec_fn=limit, timeout=ctx.timeout)  # fmt: skip
        ran = Ran(rc=proc.returncode, out=proc.stdout, err=proc.stderr)
        copy = run_dir
    fill_from_stderr(row, ran)
    ckpts = sorted(p.name for p in (copy / "trainer").glob("*")) if copy.exists() else []
    complete = [c for c in ckpts if (copy / "trainer" / c / "meta.json").is_file()]
    partial = sorted(set(ckpts) - set(complete))
    resumed = None
    if complete and ran.rc != 0:
        res = run_cmd(ctx, [*script("miles"), "train", "--resume", str(copy), "--no-progress",
                            "--steps", "2"])  # fmt: skip
        resumed = res.rc == 0 and [r["step"] for r in metrics_rows(copy)] == [1, 2]
    row.intact = bool(complete) and not partial and bool(resumed)
    row.checked = (
        f"complete checkpoints {complete}, partial {partial or 'none'}; `miles train --resume` "
        f"from a copy reaches step 2: {resumed}"
    )
    row.note = how
    row.holds = ran.rc == 2 and row.stderr_lines == 1 and not row.traceback and row.intact
    if row.traceback:
        row.note += "; NOT one line: the checkpoint writer's exception reaches the user"
    return row


def _hung_reward(ctx: Ctx, key: str, policy: str | None) -> Row:
    sets = ["task.reward_fn=rt_rewards:hang", "task.reward_timeout_s=1",
            "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]  # fmt: skip
    if policy:
        sets.append(f"task.reward_errors={policy}")
    row = Row(
        key=key,
        fault=f"a hung reward function (reward_errors={policy or 'drop, the default'})",
        tried="`miles train --set task.reward_fn=rt_rewards:hang --set task.reward_timeout_s=1"
        + (f" --set task.reward_errors={policy}`" if policy else "`")
        + " (the function sleeps an hour)",
    )
    root = ctx.dir(key)
    (root / "rt_rewards.py").write_text(
        "import time\n\n\ndef hang(sample):\n    time.sleep(3600)\n    return 1.0\n"
    )
    run = root / "run"
    t0 = time.monotonic()
    ran = run_cmd(ctx, miles_train(ctx, run, *sets), cwd=root, env=ctx.env(PYTHONPATH=str(root)))
    took = time.monotonic() - t0
    fill_from_stderr(row, ran)
    rows = metrics_rows(run)
    if policy == "zero":
        errors = rows[0].get("rollout/reward_errors") if rows else None
        row.saw = f"rollout/reward_errors={errors}; each sample's timeout logged"
        row.intact = ran.rc == 0 and errors == 4.0
        row.checked = f"the run finished in {took:.0f} s with the 4 timed-out samples at reward 0"
    else:
        row.intact = not rows
        row.checked = f"stopped in {took:.0f} s before training on nothing; no step recorded"
    row.holds = took < 120 and bool(row.intact) and not row.traceback
    if policy != "zero":
        row.holds = row.holds and ran.rc != 0 and "nothing to train on" in row.saw
    return row


def row_hung_reward(ctx: Ctx) -> Row:
    return _hung_reward(ctx, "hung-reward", None)


def row_hung_reward_zero(ctx: Ctx) -> Row:
    return _hung_reward(ctx, "hung-reward-zero", "zero")


ROWS: dict[str, Callable[[Ctx], Row]] = {
    "unauthenticated-engine": row_unauthenticated_engine,
    "unauthenticated-sessions": row_unauthenticated_sessions,
    "unauthenticated-weight-server": row_unauthenticated_weight_server,
    "unauthenticated-p2p": row_unauthenticated_p2p,
    "yaml": row_yaml,
    "engine-url": row_engine_url,
    "corrupt-config": row_corrupt_config,
    "corrupt-weights": row_corrupt_weights,
    "recipe-raises": row_recipe_raises,
    "busy-port": row_busy_port,
    "delta-null-chunk": row_delta_null_chunk,
    "quant-corrupt": row_quant_corrupt,
    "quant-no-weight-map": row_quant_no_weight_map,
    "env-missing-dir": row_env_missing,
    "offload-manifest": row_offload_manifest,
    "adamw-resume-false": row_adamw_resume_false,
    "big-body": row_big_body,
    "queue-full": row_queue_full,
    "killed-engine": row_killed_engine,
    "full-disk": row_full_disk,
    "hung-reward": row_hung_reward,
    "hung-reward-zero": row_hung_reward_zero,
}
# Rows that never read the model (busy-port: the port is bound before the model is read).
NEEDS_NO_MODEL = {
    "yaml",
    "recipe-raises",
    "env-missing-dir",
    "offload-manifest",
    "adamw-resume-false",
    "unauthenticated-weight-server",
    "unauthenticated-p2p",
    "busy-port",
}


# ---- drivers: the in-library parts, each in its own child process -----------------------------


def drive_perturb(path: str) -> dict[str, Any]:
    """Add small noise to a third of one tensor of ``path/model.safetensors`` (a new version)."""
    import torch
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    name = sorted(tensors)[0]
    t = tensors[name].clone()
    flat = t.view(-1)
    flat[: flat.numel() // 3] += 0.01 * torch.randn(
        flat.numel() // 3, generator=torch.Generator().manual_seed(0)
    )
    tensors[name] = t
    save_file(tensors, file, metadata={"format": "pt"})
    return {"changed": name}


def drive_weight_server(path: str) -> dict[str, Any]:
    """A keyed WeightServer over a small module; an update without the key, then with it."""
    import torch
    from safetensors.torch import save_file

    from miles_transfer import ModuleReceiver
    from miles_transfer.push import WeightServer

    torch.manual_seed(0)
    module = torch.nn.Linear(16, 16)
    other = Path(path) / "other"
    other.mkdir(exist_ok=True)
    save_file({n: torch.randn_like(t) for n, t in module.state_dict().items()},
              other / "model.safetensors")  # fmt: skip
    with WeightServer(ModuleReceiver(module), api_key=KEY) as server:
        before = http("POST", server.url + "/weights_checksum", {}, key=KEY)[2]
        status, _, body = http("POST", server.url + "/update_weights_from_disk",
                               {"model_path": str(other)})  # fmt: skip
        after = http("POST", server.url + "/weights_checksum", {}, key=KEY)[2]
        keyed, _, _ = http("POST", server.url + "/update_weights_from_disk",
                           {"model_path": str(other)}, key=KEY)  # fmt: skip
        changed = http("POST", server.url + "/weights_checksum", {}, key=KEY)[2] != before
    return {"status": status, "body": body, "checksum_before": before, "checksum_after": after,
            "keyed_status": keyed, "keyed_changed": changed}  # fmt: skip


def drive_p2p() -> dict[str, Any]:
    """A keyed TCP transport; an unkeyed peer and a wrong-key peer try to connect."""
    import datetime as dt
    import struct

    import torch
    import torch.distributed as dist

    from miles_transfer.p2p.transports import TcpTransport, TransportError
    from miles_transfer.p2p.transports.auth import SignedStore

    timeout = dt.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout, wait_for_workers=False)  # type: ignore[attr-defined]
    receiver = TcpTransport(store, 1, prefix="r", timeout=5, api_key=KEY)
    out: dict[str, Any] = {}
    try:
        host, port = SignedStore(store, KEY).get("r/addr/1").decode().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(struct.pack("<q", 0) + b"\0" * 64)  # the unkeyed hello, then shard bytes
            s.settimeout(10)
            try:
                out["closed"] = s.recv(1) == b""
            except ConnectionResetError:
                out["closed"] = True
        out["saw"] = "connection closed by the receiver" if out["closed"] else "connection open"
        wrong = TcpTransport(store, 0, prefix="r", timeout=5, api_key="another-key")
        try:
            wrong.send(1, torch.zeros(8, dtype=torch.uint8))
            out["wrong_key_refused"] = False
        except TransportError as e:
            out["wrong_key_refused"] = True
            out["saw"] += f"; wrong key: TransportError: {str(e).splitlines()[0]}"
        finally:
            wrong.close()
        try:
            receiver.recv(0, torch.zeros(8, dtype=torch.uint8))
            out["no_connection"] = False
        except TransportError:
            out["no_connection"] = True
        # The mesh still works for a peer with the key (a fresh prefix: a new rendezvous).
        a = TcpTransport(store, 0, prefix="ok", timeout=30, api_key=KEY)
        b = TcpTransport(store, 1, prefix="ok", timeout=30, api_key=KEY)
        sent = torch.arange(64, dtype=torch.uint8)
        got = torch.zeros(64, dtype=torch.uint8)
        t = threading.Thread(target=a.send, args=(1, sent))
        t.start()
        b.recv(0, got)
        t.join()
        out["keyed_ok"] = bool(torch.equal(sent, got))
        a.close()
        b.close()
    finally:
        receiver.close()
    return out


def drive_offload(path: str, case: str) -> dict[str, Any]:
    """Commit two AdamW steps to NVMe-style state in ``path``, then the bad open of ``case``."""
    import torch

    import miles_offload as mo

    root = Path(path)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(64, 96, generator=g).requires_grad_() for _ in range(3)]
    opt = mo.AdamW(params, lr=1e-2, offload="nvme", path=root, bucket_mb=0.05)
    for _ in range(2):
        opt.zero_grad()
        torch.stack([(p * p).sum() for p in params]).sum().backward()
        opt.step()
    opt.close()
    if case == "manifest":
        manifest = json.loads((root / "manifest.json").read_text())
        (root / "manifest.json").write_text(json.dumps([manifest]))
    before = digest_tree(root)
    fresh = [torch.zeros_like(p).requires_grad_() for p in params]
    out: dict[str, Any] = {"type": None, "error": "no error"}
    try:
        mo.AdamW(fresh, lr=1e-2, offload="nvme", path=root, bucket_mb=0.05,
                 resume=case == "manifest").close()  # fmt: skip
    except Exception as e:  # the row records whatever the user got
        out["type"] = type(e).__name__
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    out["unchanged"] = digest_tree(root) == before
    out["params_untouched"] = all(int(torch.count_nonzero(p)) == 0 for p in fresh)
    if case == "resume-false":
        again = [p.detach().clone().requires_grad_() for p in params]
        try:
            mo.AdamW(again, lr=1e-2, offload="nvme", path=root, bucket_mb=0.05, resume=True).close()
            out["resumes"] = True
        except Exception:
            out["resumes"] = False
    return out


DRIVERS: dict[str, Callable[..., dict[str, Any]]] = {
    "perturb": drive_perturb,
    "weight-server": drive_weight_server,
    "p2p": drive_p2p,
    "offload": drive_offload,
}


# ---- the table --------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[Row], *, command: str, commit: str, seconds: float) -> str:
    """The markdown page: a header (command, date, commit) and one table row per fault."""
    held = sum(r.holds for r in rows)
    today = datetime.date.today().isoformat()
    lines = [
        "# Reliability: faults and bad input, as a user meets them",
        "",
        f"Generated by `{command}` on {today} at commit `{commit}` in {seconds:.0f} s "
        "(2 shared CPU cores). Every row was performed for real against the installed console "
        "scripts or a real server in its own process; nothing here is written by hand. "
        "Regenerate after changing an error path.",
        "",
        f"**{held} of {len(rows)} rows hold**; a row holds when the user got one line naming the "
        "problem (exit 2 for bad input), or the HTTP refusal issue 31 asks for, and the check "
        "afterwards found nothing lost or half-applied.",
        "",
        "Paths under the run's temporary directory read `$WORK`. "
        "Columns: *saw* is the exit code and the first stderr line that is ours, or the HTTP "
        "status and body; *lines* counts our non-empty stderr lines (third-party import "
        "warnings, e.g. torchao's optional kernels, counted apart in *noise*); *intact* is "
        "what was checked afterwards.",
        "",
        "| Fault or bad input | What was tried | What the user saw | Lines (noise) | "
        "Lost or half-applied? | Holds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        code = f"HTTP {r.status}: " if r.status is not None else ""
        code = f"exit {r.exit_code}: " if r.exit_code is not None and not code else code
        saw = code + r.saw + (" (traceback)" if r.traceback else "")
        lost = ("nothing: " if r.intact else "LOST/CHANGED: " if r.intact is False else "") + (
            r.checked
        )
        holds = "yes" if r.holds else "**NO**"
        if r.note:
            holds += f" ({r.note})"
        lines.append(
            f"| {_cell(r.fault)} (`{r.key}`) | {_cell(r.tried)} | {_cell(saw)} | "
            f"{r.stderr_lines} ({r.noise_lines}) | {_cell(lost)} | {_cell(holds)} |"
        )
    failing = [r for r in rows if not r.holds]
    if failing:
        lines += ["", "## Rows that do not hold", ""]
        lines += [f"- `{r.key}`: {r.saw} ({r.note or r.checked})" for r in failing]
    return "\n".join(lines) + "\n"


def run_rows(keys: list[str], *, model: Path | None, work: Path,
             log: Callable[[str], None] = print) -> list[Row]:  # fmt: skip
    """Run the named rows (in table order) in ``work``; an unexpected error fails its row."""
    unknown = sorted(set(keys) - set(ROWS))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if model is None:
        if set(keys) <= NEEDS_NO_MODEL:
            model = work / "no-model"
        else:
            tool = _load_make_tiny_model()
            log("building the tiny model (tools/make_tiny_model.py, sft_steps=20)...")
            model = Path(tool.build(tool.TinyModelSpec(sft_steps=20), work / "model", quiet=True))
    ctx = Ctx(work=work, model=model)
    rows = []
    try:
        for key in [k for k in ROWS if k in keys]:
            t0 = time.monotonic()
            try:
                row = ROWS[key](ctx)
            except Exception as e:  # a broken row is a row that does not hold, not a crash
                row = Row(key=key, fault=key, tried="(the row itself failed)",
                          saw=f"{type(e).__name__}: {str(e)[:300]}", note="row error")  # fmt: skip
            row.seconds = time.monotonic() - t0
            # The work directory's path changes every run: "$WORK" in the table.
            row.saw, row.checked = (t.replace(str(work), "$WORK") for t in (row.saw, row.checked))
            log(f"{key}: {'holds' if row.holds else 'DOES NOT HOLD'} ({row.seconds:.0f} s) "
                f"{row.saw[:120]}")  # fmt: skip
            rows.append(row)
    finally:
        for stop in reversed(ctx.cleanup):
            stop()
    return rows


def _load_make_tiny_model() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_make_tiny_model", REPO / "tools" / "make_tiny_model.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--only", default=None, help=f"comma-separated rows of: {','.join(ROWS)}")
    parser.add_argument("--model", type=Path, default=None, help="the tiny model (else built)")
    parser.add_argument("--work", type=Path, default=None, help="keep the work files here")
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.driver:
        print(json.dumps(DRIVERS[args.driver](*rest)), flush=True)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    keys = args.only.split(",") if args.only else list(ROWS)
    t0 = time.monotonic()
    with contextmanager(_workdir)(args.work) as work:
        rows = run_rows(keys, model=args.model, work=work)
    command = "python tools/reliability_table.py" + (f" --only {args.only}" if args.only else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, command=command, commit=_commit(),
                               seconds=time.monotonic() - t0))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"{sum(r.holds for r in rows)} of {len(rows)} rows hold; wrote {args.out}")
    return 0


def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="miles-reliability-") as d:
        yield Path(d)


if __name__ == "__main__":
    sys.exit(main())
