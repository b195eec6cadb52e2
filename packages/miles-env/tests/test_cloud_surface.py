"""Offline checks of the cloud adapters: every SDK method and parameter an adapter calls
exists in the installed SDK (inside the version range the extras declare), a missing SDK
fails with the pip command, and the command framing used for SDKs with one output stream
round-trips through a real shell. Live runs are in test_conformance.py (keys needed)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from miles_env import create_sandbox
from miles_env.backends import _cloud, agentenv, availability, daytona, e2b, modal

ADAPTERS = {"daytona": daytona, "e2b": e2b, "modal": modal, "agentenv": agentenv}
DIST = {"daytona": "daytona", "e2b": "e2b", "modal": "modal", "agentenv": "agv"}
SDK_MODULE = {"daytona": "daytona", "e2b": "e2b", "modal": "modal", "agentenv": "agentenv"}
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _resolve(path: str) -> object:
    module, _, attrs = path.partition(":")
    obj: object = importlib.import_module(module)
    for a in attrs.split("."):
        obj = getattr(obj, a)
    return obj


def _params(obj: object) -> set[str]:
    fields = getattr(obj, "model_fields", None)  # pydantic models take their fields
    if isinstance(fields, dict):
        return set(fields)
    return set(inspect.signature(obj).parameters)  # type: ignore[arg-type]


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_sdk_surface(name: str) -> None:
    dist = DIST[name]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} not installed (pip install 'miles-env[{name}]')")
    # The installed SDK is inside the range of the package's extra.
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (req,) = extras[name]
    lo = re.search(r">=([\d.]+)", req)
    hi = re.search(r"<([\d.]+)", req)
    assert lo is not None
    assert hi is not None
    assert _version_tuple(lo.group(1)) <= _version_tuple(version) < _version_tuple(hi.group(1))
    for path, used in ADAPTERS[name].SDK_SURFACE:
        obj = _resolve(path)
        missing = set(used) - _params(obj)
        assert not missing, f"{dist} {version}: {path} has no parameter(s) {sorted(missing)}"
    for path in getattr(ADAPTERS[name], "SDK_AIO", []):
        assert hasattr(_resolve(path), "aio"), f"{dist} {version}: {path} has no .aio variant"


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_missing_sdk_names_the_extra(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in list(sys.modules):
        if mod == SDK_MODULE[name] or mod.startswith(SDK_MODULE[name] + "."):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, SDK_MODULE[name], None)  # import now fails
    spec = {"network": "public"} if name == "agentenv" else {}
    with pytest.raises(ImportError, match=re.escape(f"pip install 'miles-env[{name}]'")):
        _run(create_sandbox(spec, backend=name))


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_availability_without_key(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("DAYTONA_API_KEY", "E2B_API_KEY", "MODAL_TOKEN_ID", "AGENTENV_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    ok, why = availability(name)
    assert not ok
    assert "not set" in why or "not installed" in why


def _run(coro):  # type: ignore[no-untyped-def]
    import asyncio

    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("argv", "cwd", "env", "timeout", "expect"),
    [
        (["sh", "-c", "echo out; echo err >&2; exit 7"], "/", {}, None, ("out\n", "err\n", 7)),
        (["printf", "%s", "a b", "$X"], "/tmp", {"X": "1"}, None, ("a b$X", "", 0)),
        (
            ["sh", "-c", 'printf "%s" "$X"; pwd >&2'],
            "/tmp",
            {"X": "v w"},
            None,
            ("v w", "/tmp\n", 0),
        ),
        (["sh", "-c", "sleep 30"], "/", {}, 0.5, ("", "", 124)),
        (["true"], "/no/such/dir", {}, None, None),
    ],
)
def test_framed_script_round_trip(argv, cwd, env, timeout, expect) -> None:  # type: ignore[no-untyped-def]
    script, marker = _cloud.framed_script(argv, cwd=cwd, env=env, timeout=timeout)
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    parsed = _cloud.parse_framed(r.stdout, marker)
    assert parsed is not None
    if expect is None:  # a missing cwd: an error result, not an exception
        assert parsed[2] != 0
        assert "no/such/dir" in parsed[1]
    else:
        assert parsed == expect


def test_b64_write_commands_round_trip(tmp_path: Path) -> None:
    data = bytes(range(256)) * 500  # several chunks
    target = tmp_path / "sub" / "blob"
    for cmd in _cloud.b64_write_commands(str(target), data):
        subprocess.run(["sh", "-c", cmd], check=True)
    assert target.read_bytes() == data
