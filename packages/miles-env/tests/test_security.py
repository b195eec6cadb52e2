"""Attacks on the local sandbox, each with a measured outcome: network egress, host files,
privilege escalation, fork bomb, memory bomb, disk fill, runaway time, processes left behind
(after close, after a killed interpreter, at interpreter exit).

Every test prints a ``FIGURE`` line (``pytest -s``): what was tried and what happened; the
package README's security table is copied from them. Network probes target only a server
this test runs on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _env_testlib import Loop, needs_local, needs_root

from miles_env import ExecResult, SandboxClosedError, create_sandbox
from miles_env.backends import cgroups as cgroups_mod
from miles_env.backends.local import LocalSandbox

pytestmark = [needs_local, needs_root]


def figure(what: str, outcome: str) -> None:
    print(f"\nFIGURE | {what} | {outcome}")


def uid_pids(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid``, zombies left out (dead, awaiting their reaper:
    a killed command whose parent, the host-side nsenter, died with it is reaped by the
    host's init)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{entry}/status").read_text().splitlines()
            )
        except (OSError, ValueError):
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            out.append(int(entry))
    return out


def wait_until(cond, deadline_s: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


async def make(**spec: object) -> LocalSandbox:
    sb = await create_sandbox({"ttl_s": 300, **spec})
    assert isinstance(sb, LocalSandbox)
    return sb


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on the host's 127.0.0.1 that counts accepted connections."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    accepted: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(1)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    port = srv.getsockname()[1]
    yield port
    stop.set()
    t.join()
    srv.close()


PROBE = (
    "import socket,sys\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2).close(); print('connected')\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)


def test_network_egress(loop: Loop, host_server: int) -> None:
    async def go() -> tuple[str, str, str, str]:
        async with await make(network="none") as sb:
            probe = (await sb.exec(["python3", "-c", PROBE, str(host_server)])).stdout.strip()
            ifaces = (await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1")).stdout.split()
            routes = (await sb.exec("tail -n +2 /proc/net/route | wc -l")).stdout.strip()
        async with await make(network="public") as sb:
            control = (await sb.exec(["python3", "-c", PROBE, str(host_server)])).stdout.strip()
        return probe, " ".join(ifaces), routes, control

    probe, ifaces, routes, control = loop.run(go())
    assert probe == "ConnectionRefusedError"  # its own loopback: nothing listens there
    assert ifaces == "lo"
    assert routes == "0"
    assert control == "connected"  # the probe works: with network='public' it gets through
    figure(
        "network egress (network='none'): connect to a server on the host's 127.0.0.1",
        f"{probe}; interfaces: {ifaces}; routes: {routes} (control, network='public': {control})",
    )


def test_host_files(loop: Loop, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    before = secret.stat().st_mtime_ns

    async def go() -> dict[str, str]:
        out = {}
        async with await make() as sb:
            for name, cmd in {
                "read host tmp file": f"cat {secret}",
                "read /etc/shadow": "cat /etc/shadow",
                "list /root": "ls /root",
                "write /usr/bin": "touch /usr/bin/pwned",
                "write /etc/passwd": "echo x >> /etc/passwd",
                "write host tmp file": f"echo pwned > {secret}",
            }.items():
                r = await sb.exec(cmd)
                assert r.exit_code != 0, (name, r)
                out[name] = r.stderr.strip().split(": ")[-1]
            visible = (await sb.exec("ls /")).stdout.split()
            assert set(visible) <= {
                "bin",
                "dev",
                "etc",
                "home",
                "lib",
                "lib32",
                "lib64",
                "libx32",
            }.union({"proc", "sbin", "tmp", "usr", "workspace"})
            await sb.exec("mkdir -p out && ln -s /etc/passwd out/evil")
            with pytest.raises(ValueError, match="leaves the tree"):
                await sb.download_dir("out", tmp_path / "dl")
        return out

    outcomes = loop.run(go())
    assert secret.read_text() == "host secret\n"
    assert secret.stat().st_mtime_ns == before
    assert not Path("/usr/bin/pwned").exists()
    assert not (tmp_path / "dl" / "evil").exists()
    figure(
        "host files outside the workspace: " + ", ".join(outcomes),
        "; ".join(f"{k}: {v}" for k, v in outcomes.items())
        + "; download_dir of a symlink to /etc/passwd: refused",
    )


def test_privilege_escalation(loop: Loop) -> None:
    async def go() -> dict[str, str]:
        async with await make() as sb:
            status = await sb.exec("grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status")
            caps = dict(line.split(":\t") for line in status.stdout.splitlines())
            attempts = {
                "su root": "su -c id root </dev/null",
                "setuid(0)": "python3 -c 'import os; os.setuid(0)'",
                "unshare -r (new user ns)": "unshare -r id",
                "mount tmpfs": "mount -t tmpfs none /tmp",
                "remount /usr rw": "mount -o remount,rw /usr",
                "chroot": "chroot / true",
                "kill init": "kill -9 1",
            }
            results = {}
            for name, cmd in attempts.items():
                r = await sb.exec(cmd)
                results[name] = f"exit {r.exit_code}"
                if name != "kill init":
                    assert r.exit_code != 0, (name, r)
            # PID 1 inside is the sandbox's own init, which ignores signals from inside its
            # PID namespace (kill returns 0, nothing happens); host processes are invisible.
            ps = (await sb.exec("ls /proc | grep -c '^[0-9]'")).stdout.strip()
            await sb.exec("nohup sleep 600 >/dev/null 2>&1 &")
            host_pids = sb._cg.members() if sb._cg is not None else []
            uids = set()
            for pid in host_pids:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("Uid:"):
                        uids.add(int(line.split()[1]))
            assert sb.alive()  # after `kill -9 1`
            results["kill init"] += " (ignored, sandbox alive)"
            results["caps"] = f"CapEff {caps['CapEff']}, NoNewPrivs {caps['NoNewPrivs']}"
            results["processes visible"] = ps
            results["host uids"] = ",".join(map(str, sorted(uids)))
            assert caps["CapEff"] == "0000000000000000"
            assert caps["CapPrm"] == "0000000000000000"
            assert caps["NoNewPrivs"] == "1"
            assert uids == {sb.host_uid}
            assert sb.host_uid != 0
            assert int(ps) < 10
        return results

    results = loop.run(go())
    figure(
        "privilege escalation: " + ", ".join(k for k in results if "exit" in results[k]),
        "; ".join(f"{k}: {v}" for k, v in results.items()),
    )


# Every process forks for ever and shrugs off failed forks (a shell bomb ends by itself:
# dash exits on its first failed fork).
BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def test_fork_bomb(loop: Loop) -> None:
    async def go() -> tuple[ExecResult, int, int, str, int]:
        sb = await make(pids=64, cpus=0.5)
        assert sb._cg is not None
        pids_dir = sb._cg.limit_dirs["pids"]
        peak = 0
        done = asyncio.Event()

        async def sample() -> None:  # the peak number of processes, while the bomb runs
            nonlocal peak
            while not done.is_set():
                peak = max(peak, int((pids_dir / "pids.current").read_text()))
                await asyncio.sleep(0.005)

        sampler = asyncio.ensure_future(sample())
        r = await sb.exec(["python3", "-c", BOMB], timeout=2)
        done.set()
        await sampler
        failures = int((pids_dir / "pids.events").read_text().split()[1])
        after = (await sb.exec("echo usable")).stdout.strip()
        uid = sb.host_uid
        await sb.close()
        return r, peak, failures, after, len(uid_pids(uid))

    r, peak, failures, after, left = loop.run(go())
    assert r.timed_out
    assert peak <= 64
    assert failures > 0  # the limit was hit: forks beyond it failed
    assert after == "usable"  # the timeout killed the whole tree, background bombs included
    assert left == 0
    figure(
        "fork bomb (python: every process forks for ever), pids=64, cpus=0.5, timeout=2",
        f"exit {r.exit_code} (timed out) after {r.duration_s:.1f} s; at most {peak} processes "
        f"(pids.max 64; {failures} forks refused); then `echo` ran: {after}; "
        f"{left} left after close",
    )


def test_memory_bomb(loop: Loop) -> None:
    bomb = "a = []\nwhile True:\n    a.append(bytearray(16 << 20))\n"

    async def go() -> tuple[int, int, str, int]:
        async with await make(memory_mb=96) as sb:
            r = await sb.exec(["python3", "-c", bomb], timeout=60)
            after = (await sb.exec("echo alive")).stdout.strip()
            assert sb._cg is not None
            mem_dir = sb._cg.limit_dirs["memory"]
            peak_file = "memory.max_usage_in_bytes" if mem_dir != sb._cg.v2_dir else "memory.peak"
            peak = int((mem_dir / peak_file).read_text())
            return r.exit_code, sb.oom_kills(), after, peak

    rc, kills, after, peak = loop.run(go())
    assert rc == 137  # SIGKILL by the memory cgroup's OOM killer
    assert kills >= 1
    assert after == "alive"
    assert peak <= 96 * 1024 * 1024
    figure(
        "memory bomb (python appending 16 MiB buffers) with memory_mb=96",
        f"exit {rc} (SIGKILL), oom kills {kills}, peak {peak / 2**20:.1f} MiB, sandbox {after}",
    )


FILL = (
    "import errno, sys\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        with open(f'{sys.argv[1]}/f{n}', 'wb') as f:\n"
    "            f.write(b'x' * (1 << 20))\n"
    "        n += 1\n"
    "except OSError as e:\n"
    "    print(n, errno.errorcode[e.errno])\n"
)


def test_disk_fill(loop: Loop) -> None:
    async def go() -> tuple[str, str, int, str]:
        async with await make(disk_mb=16) as sb:
            ws = (await sb.exec(["python3", "-c", FILL, "."])).stdout.strip()
            tmp = (await sb.exec(["python3", "-c", FILL, "/tmp"])).stdout.strip()
            used = int(
                (await sb.exec("du -sk /workspace /tmp | cut -f1 | paste -sd+ | bc")).stdout or 0
            )
            fstype = (await sb.exec("stat -f -c %T /workspace")).stdout.strip()
            return ws, tmp, used, fstype

    ws, tmp, used_kb, fstype = loop.run(go())
    assert ws.endswith("ENOSPC")
    assert int(ws.split()[0]) <= 16
    assert tmp == "0 ENOSPC"  # /tmp shares the one budget
    assert used_kb <= 16 * 1024
    assert fstype == "tmpfs"  # in memory (counted by the memory limit): no host disk used
    figure(
        "disk fill: 1 MiB files into the workspace until an error, then into /tmp; disk_mb=16",
        f"workspace: {ws.split()[0]} files then {ws.split()[1]}; /tmp: {tmp.split()[0]} files then "
        f"{tmp.split()[1]}; {used_kb / 1024:.1f} MiB used; filesystem {fstype}",
    )


def test_runaway_time(loop: Loop) -> None:
    async def go() -> tuple[bool, int, float, str, float, bool]:
        async with await make() as sb:
            r = await sb.exec("while :; do :; done", timeout=1)
        sb = await make(ttl_s=1.0)  # no timeout on the command: the sandbox's ttl_s ends it
        try:
            start = time.monotonic()
            try:
                await sb.exec("sleep 600")
                died = "no"
            except SandboxClosedError as e:
                died = str(e)
            waited = time.monotonic() - start
            alive = sb.alive()
        finally:
            await sb.close()
        return r.timed_out, r.exit_code, r.duration_s, died, waited, alive

    timed_out, rc, dur, died, waited, alive = loop.run(go())
    assert timed_out
    assert rc == 124
    assert "ttl_s=1" in died
    assert not alive
    figure(
        "runaway time: busy loop with timeout=1; `sleep 600` without a timeout, ttl_s=1",
        f"busy loop killed after {dur:.2f} s (exit {rc}); the sleep ended after {waited:.2f} s "
        f"with the sandbox: {died}",
    )


def test_nothing_left_after_close(loop: Loop) -> None:
    async def go() -> tuple[int, int, list[Path]]:
        sb = await make()
        await sb.exec("setsid nohup sleep 600 >/dev/null 2>&1 &")
        await sb.exec("(sh -c 'sleep 600 & sleep 600' &) >/dev/null 2>&1")
        await sb.exec(
            "python3 -c 'import os,time\nif os.fork()==0:\n os.setsid(); time.sleep(600)' &"
        )
        uid = sb.host_uid
        before = len(uid_pids(uid))
        assert sb._cg is not None
        dirs = [*sb._cg.v1_dirs, *([sb._cg.v2_dir] if sb._cg.v2_dir else [])]
        await sb.close()
        return uid, before, dirs

    uid, before, dirs = loop.run(go())
    assert before >= 5
    left = uid_pids(uid)  # close() waited for the cgroup to empty: no polling needed
    assert left == []
    assert not any(d.exists() for d in dirs)
    figure(
        "processes left behind: setsid/nohup/double-fork daemons, then close()",
        f"{before} processes of the sandbox uid before close, {len(left)} after; "
        f"{len(dirs)} cgroups removed",
    )


CHILD = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    import miles_env

    async def main():
        sb = await miles_env.create_sandbox({"ttl_s": 300})
        await sb.exec("setsid nohup sleep 600 >/dev/null 2>&1 &")
        dirs = [str(d) for d in sb._cg.v1_dirs] + ([str(sb._cg.v2_dir)] if sb._cg.v2_dir else [])
        print(json.dumps({"uid": sb.host_uid, "dirs": dirs}), flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_interpreter_end_leaves_nothing(how: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=120
    )
    info = json.loads(r.stdout.splitlines()[-1])
    uid, dirs = info["uid"], [Path(d) for d in info["dirs"]]
    if how == "exit":  # atexit closed it before the interpreter was gone
        assert r.returncode == 0, r.stderr
        assert uid_pids(uid) == []
        assert not any(d.exists() for d in dirs)
        outcome = "atexit closed it: no process, no cgroup left"
    else:  # SIGKILL: no Python code ran; the kernel ends the sandbox (die-with-parent)
        assert r.returncode == -9
        assert wait_until(lambda: not uid_pids(uid))
        removed = cgroups_mod.remove_stale(cgroups_mod.CgroupHost.discover())
        assert removed >= 1
        assert not any(d.exists() for d in dirs)
        outcome = (
            f"all processes gone (die-with-parent); {removed} stale cgroups removed by the "
            "next create"
        )
    figure(
        f"interpreter {'SIGKILLed' if how == 'kill' else 'exiting'} with a sandbox open", outcome
    )
