"""What only the local backend does: its limits (both ways of setting rlimits), cgroups off,
the v1 freezer as process tracker, cancellation, background output, output cap, rootfs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from _env_testlib import Loop, needs_local, needs_root

from miles_env import SandboxSpec, create_sandbox
from miles_env.backends import local
from miles_env.backends.cgroups import CgroupHost, SandboxCgroups
from miles_env.backends.local import LocalSandbox

pytestmark = [needs_local, needs_root]


def _limits(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        out[name] = soft
    return out


@pytest.mark.parametrize("dash", [True, False], ids=["dash-ulimit", "prlimit"])
def test_rlimits(loop: Loop, monkeypatch: pytest.MonkeyPatch, dash: bool) -> None:
    if dash and not local._DASH:
        pytest.skip("/bin/sh is not dash")
    monkeypatch.setattr(local, "_DASH", dash)

    async def go() -> dict[str, str]:
        async with await create_sandbox({"pids": 50, "disk_mb": 8}) as sb:
            return _limits((await sb.exec("cat /proc/self/limits")).stdout)

    lim = loop.run(go())
    assert lim["Max processes"] == "66"  # pids + 16: the pids cgroup is the limit
    assert lim["Max file size"] == str(8 * 1024 * 1024)
    assert lim["Max core file size"] == "0"


def test_without_cgroups(loop: Loop) -> None:
    async def go() -> None:
        sb = await create_sandbox({"memory_mb": 64, "pids": 32}, cgroups=False)
        assert isinstance(sb, LocalSandbox)
        async with sb:
            assert sb.enforced == {"memory": None, "pids": None, "cpu": None, "kill": None}
            lim = _limits((await sb.exec("cat /proc/self/limits")).stdout)
            assert lim["Max address space"] == str(64 * 1024 * 1024)  # the fallback
            assert lim["Max processes"] == "32"
            r = await sb.exec("sleep 600 & echo $! > /tmp/p; wait", timeout=1)
            assert r.timed_out
            gone = await sb.exec("kill -0 $(cat /tmp/p) 2>/dev/null || echo gone")
            assert gone.stdout == "gone\n"  # same process group: killed with the command

    loop.run(go())


def test_freezer_tracker(tmp_path: Path) -> None:
    host = CgroupHost.discover()
    if "freezer" not in host.v1:
        pytest.skip("no v1 freezer hierarchy here")
    v1_only = CgroupHost(v1=dict(host.v1), v2=None)
    cg = SandboxCgroups.create(
        f"{os.getpid()}-freezertest", memory_mb=128, pids=32, cpus=1.0, host=v1_only
    )
    try:
        assert cg.tracker == "freezer"
        files = cg.procs_files("e0")
        script = 'for f in "$@"; do echo $$ > "$f"; done; (setsid sleep 600 &); sleep 600 & wait'
        p = subprocess.Popen(["sh", "-c", script, "sh", *files])
        deadline = time.monotonic() + 20
        while len(cg.members("e0")) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(cg.members("e0")) >= 3
        assert cg.kill("e0")
        assert cg.members("e0") == []
        p.wait(timeout=20)
        assert cg.release("e0")
    finally:
        cg.remove()
    assert not any(d.exists() for d in cg.v1_dirs)


# A killed command's shell can stay a zombie for a moment: its parent was the host-side
# nsenter, killed with it, so the host's init reaps it. Dead either way.
RUNNING = 'p=$(cat /tmp/pid); s=$(cut -d" " -f3 /proc/$p/stat 2>/dev/null); echo "${s:-gone}"'


def test_cancel_kills_command(loop: Loop) -> None:
    async def go() -> str:
        async with await create_sandbox() as sb:
            task = asyncio.ensure_future(sb.exec("echo $$ > /tmp/pid; sleep 600"))
            for _ in range(2000):
                if (await sb.exec("cat /tmp/pid 2>/dev/null")).stdout:
                    break
                await asyncio.sleep(0.01)
            assert (await sb.exec(RUNNING)).stdout.strip() in ("S", "R")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await sb.exec(RUNNING)).stdout.strip()

    assert loop.run(go()) in ("gone", "Z")


def test_background_output(loop: Loop) -> None:
    async def go() -> tuple[str, str]:
        async with await create_sandbox() as sb:
            # The background writer holds stdout open: exec returns anyway, and its later
            # writes (to a pipe nobody reads into a result) do not kill it with SIGPIPE.
            r = await sb.exec("echo now; (sleep 0.3; echo later; echo ok > /tmp/done) &")
            for _ in range(2000):
                done = await sb.exec("cat /tmp/done 2>/dev/null")
                if done.stdout:
                    break
                await asyncio.sleep(0.01)
            return r.stdout, done.stdout

    out, done = loop.run(go())
    assert out == "now\n"
    assert done == "ok\n"


def test_output_cap(loop: Loop) -> None:
    async def go() -> tuple[int, bool, str]:
        async with await create_sandbox(max_output_bytes=1000) as sb:
            r = await sb.exec("head -c 100000 /dev/zero | tr '\\0' x; echo; echo tail >&2")
            with pytest.raises(OSError, match="max_output_bytes"):
                await sb.read_file("/etc/services")
            return len(r.stdout), r.truncated, r.stderr

    n, truncated, err = loop.run(go())
    assert n == 1000
    assert truncated
    assert err == "tail\n"


def test_refusals(loop: Loop) -> None:
    async def go() -> None:
        with pytest.raises(ValueError, match="no container images"):
            await create_sandbox({"image": "python:3.12"})
        with pytest.raises(ValueError, match="allowlist"):
            await create_sandbox({"network": ["10.0.0.0/8"]})
        async with await create_sandbox() as sb:
            with pytest.raises(ValueError, match=r"one\s+unprivileged user"):
                await sb.exec("id", user="root")
            with pytest.raises(ValueError, match="empty command"):
                await sb.exec("  ")
            with pytest.raises(ValueError, match="not a valid variable name"):
                await sb.exec("true", env={"A-B": "1"})

    loop.run(go())
    with pytest.raises(ValueError, match="workdir"):
        SandboxSpec(workdir="relative")
    with pytest.raises(ValueError, match="under /usr"):
        SandboxSpec(workdir="/usr/src")
    with pytest.raises(ValueError, match="unknown key"):
        SandboxSpec.coerce({"memory": 1})


def test_rootfs(loop: Loop) -> None:
    # The host's own / as a rootfs: every top-level directory bound read-only (except the
    # ones the sandbox makes itself), the workdir and /tmp writable.
    async def go() -> tuple[str, int, str]:
        async with await create_sandbox({"rootfs": "/", "workdir": "/work2"}) as sb:
            opt = (await sb.exec("ls -d /opt /var")).stdout
            w = await sb.exec("touch /var/x")
            ok = (await sb.exec("touch /work2/x /tmp/y && echo ok")).stdout
            return opt, w.exit_code, ok

    opt, rc, ok = loop.run(go())
    assert opt.split() == ["/opt", "/var"]
    assert rc != 0
    assert ok == "ok\n"
