"""One conformance suite for every backend: the local one always; podman where podman and its
base image exist (slow); each cloud backend only where its key is set, otherwise reported as
skipped with the reason (never as passed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _env_conformance import CHECKS, check_close, check_dirs
from _env_testlib import Loop

from miles_env import Sandbox, create_sandbox
from miles_env.backends import availability

SPEC = {"env": {"MILES_SPEC": "s"}, "memory_mb": 512, "pids": 128, "disk_mb": 256, "ttl_s": 900}

BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("podman", id="podman", marks=pytest.mark.slow),
    pytest.param("daytona", id="daytona", marks=pytest.mark.network),
    pytest.param("e2b", id="e2b", marks=pytest.mark.network),
    pytest.param("modal", id="modal", marks=pytest.mark.network),
    pytest.param("agentenv", id="agentenv", marks=pytest.mark.network),
]


@pytest.fixture(scope="module", params=BACKENDS)
def backend_sandbox(request: pytest.FixtureRequest) -> Iterator[tuple[Loop, Sandbox]]:
    name = request.param
    ok, why = availability(name)
    if not ok:
        pytest.skip(f"{name}: {why}")
    lp = Loop()
    sb = lp.run(create_sandbox(SPEC, backend=name), timeout=600)
    try:
        yield lp, sb
    finally:
        lp.run(sb.close())
        lp.close()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[6:])
def test_protocol(backend_sandbox: tuple[Loop, Sandbox], check) -> None:  # type: ignore[no-untyped-def]
    lp, sb = backend_sandbox
    lp.run(check(sb))


def test_dirs(backend_sandbox: tuple[Loop, Sandbox], tmp_path: Path) -> None:
    lp, sb = backend_sandbox
    lp.run(check_dirs(sb, tmp_path))


@pytest.mark.parametrize("name", ["local"])
def test_close_and_context_manager(name: str, loop: Loop) -> None:
    ok, why = availability(name)
    if not ok:
        pytest.skip(why)

    async def go() -> None:
        sb = await create_sandbox(SPEC, backend=name)
        await check_close(sb)
        async with await create_sandbox(SPEC, backend=name) as sb2:
            assert (await sb2.exec("echo in")).stdout == "in\n"
        assert not sb2.alive()

    loop.run(go())
