"""Local sandbox costs, each against the same command run without a sandbox.

Why: an agentic RL step runs many short commands (an agent's tool calls, a verifier) in
fresh sandboxes; what a sandbox adds per command, per sandbox and per machine decides how many
episodes a rollout worker can keep going. Measured, on the local (bubblewrap) backend:

- create + first exec: ``create_sandbox`` then ``exec("true")`` (close timed apart), against
  starting ``true`` as a plain subprocess;
- exec round trip: ``exec`` of ``true`` (argv) and of ``sh -c 'echo hi'`` in a warm sandbox,
  against the same plain subprocesses;
- sandboxes per second: create + exec + close at concurrency 1, 2 and 4, against plain
  subprocesses at the same concurrency;
- peak concurrent sandboxes: sandboxes opened one by one and held (up to ``--peak``), then
  every one runs a command; memory per sandbox (PSS of its host processes, and what its
  memory cgroup is charged), against as many plain ``sleep`` processes.

Laptop (root; ~1 minute): python tools/bench/sandbox_bench.py [--peak 200] [--json out.json]
Cluster: the same on a rollout node; raise --peak to find the node's limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from miles_env import create_sandbox

SPEC = {"memory_mb": 256, "pids": 64, "disk_mb": 64, "ttl_s": 600}


async def _plain(*argv: str) -> None:
    p = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    await p.communicate()


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median_ms": 1000 * statistics.median(xs),
        "p90_ms": 1000 * xs[int(0.9 * (len(xs) - 1))],
        "n": len(xs),
    }


async def _timed(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


async def create_first_exec(n: int) -> dict[str, Any]:
    create, first, close = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await create_sandbox(SPEC)
        t1 = time.perf_counter()
        await sb.exec(["true"])
        t2 = time.perf_counter()
        await sb.close()
        t3 = time.perf_counter()
        create.append(t1 - t0)
        first.append(t2 - t0)
        close.append(t3 - t2)
    plain = await _timed(lambda: _plain("true"), n)
    return {
        "create": _stats(create),
        "create_first_exec": _stats(first),
        "close": _stats(close),
        "plain_true": _stats(plain),
    }


async def exec_round_trip(n: int) -> dict[str, Any]:
    async with await create_sandbox(SPEC) as sb:
        await sb.exec(["true"])
        true_sb = await _timed(lambda: sb.exec(["true"]), n)
        echo_sb = await _timed(lambda: sb.exec("echo hi"), n)
    return {
        "sandbox_true": _stats(true_sb),
        "plain_true": _stats(await _timed(lambda: _plain("true"), n)),
        "sandbox_sh_echo": _stats(echo_sb),
        "plain_sh_echo": _stats(await _timed(lambda: _plain("sh", "-c", "echo hi"), n)),
    }


async def per_second(total: int, concurrency: int) -> dict[str, float]:
    async def one_sandbox() -> None:
        async with await create_sandbox(SPEC) as sb:
            await sb.exec(["true"])

    async def run(job: Callable[[], Awaitable[None]]) -> float:
        sem = asyncio.Semaphore(concurrency)

        async def guarded() -> None:
            async with sem:
                await job()

        t = time.perf_counter()
        await asyncio.gather(*(guarded() for _ in range(total)))
        return total / (time.perf_counter() - t)

    return {
        "sandboxes_per_s": await run(one_sandbox),
        "plain_per_s": await run(lambda: _plain("true")),
    }


def _pss_kb(pids: list[int]) -> int:
    """Proportional set size of these processes (shared pages split among their users)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def _cgroup_memory_kb(sb: Any) -> int:
    """What the sandbox's memory cgroup is charged (its processes, tmpfs, kernel objects)."""
    d = sb._cg.limit_dirs.get("memory") if sb._cg is not None else None
    if d is None:
        return 0
    name = "memory.current" if (d / "memory.current").exists() else "memory.usage_in_bytes"
    return int((d / name).read_text()) // 1024


async def peak(limit: int) -> dict[str, Any]:
    boxes = []
    error = ""
    t = time.perf_counter()
    try:
        for _ in range(limit):
            boxes.append(await create_sandbox(SPEC))
    except Exception as e:  # the machine's limit, if reached below --peak
        error = f"{type(e).__name__}: {e}"
    opened = time.perf_counter() - t
    results = await asyncio.gather(*(sb.exec("echo ok") for sb in boxes))
    working = sum(r.stdout == "ok\n" for r in results)
    n = max(len(boxes), 1)
    host_pids = [pid for sb in boxes if sb._cg is not None for pid in sb._cg.members()]
    pss = _pss_kb(host_pids) / n
    charged = sum(_cgroup_memory_kb(sb) for sb in boxes) / n
    procs_per_box = len(host_pids) / n
    t = time.perf_counter()
    await asyncio.gather(*(sb.close() for sb in boxes))
    closed = time.perf_counter() - t
    # Peer: the same number of plain processes held at once, as many per sandbox as a
    # sandbox holds (bwrap outside, bwrap as its PID 1, the sleep).
    procs = [
        await asyncio.create_subprocess_exec("sleep", "600")
        for _ in range(round(procs_per_box * len(boxes)))
    ]
    pss_plain = _pss_kb([p.pid for p in procs]) / n
    for p in procs:
        p.kill()
        await p.wait()
    return {
        "opened": len(boxes),
        "working": working,
        "stopped_by": error or f"--peak {limit}",
        "open_s": opened,
        "close_all_s": closed,
        "processes_per_sandbox": procs_per_box,
        "pss_kb_per_sandbox": pss,
        "cgroup_kb_per_sandbox": charged,
        "pss_kb_plain_per_sandbox": pss_plain,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"loadavg_before": os.getloadavg()}
    out["create_first_exec"] = await create_first_exec(args.n_create)
    out["exec_round_trip"] = await exec_round_trip(args.n_exec)
    out["per_second"] = {c: await per_second(args.n_rate, c) for c in (1, 2, 4)}
    out["peak"] = await peak(args.peak)
    out["loadavg_after"] = os.getloadavg()
    return out


def _report(r: dict[str, Any]) -> None:
    c = r["create_first_exec"]
    e = r["exec_round_trip"]
    print(f"load average before/after: {r['loadavg_before']} / {r['loadavg_after']}")
    print("| what | sandbox median (p90) | plain median (p90) | ratio |")
    print("| --- | --- | --- | --- |")

    def row(name: str, sb: dict[str, float], plain: dict[str, float]) -> None:
        print(
            f"| {name} | {sb['median_ms']:.1f} ms ({sb['p90_ms']:.1f}) | "
            f"{plain['median_ms']:.2f} ms ({plain['p90_ms']:.2f}) | "
            f"{sb['median_ms'] / plain['median_ms']:.0f}x |"
        )

    row("create + first exec `true`", c["create_first_exec"], c["plain_true"])
    row("(of which create)", c["create"], c["plain_true"])
    row("close", c["close"], c["plain_true"])
    row("exec `true` (argv), warm", e["sandbox_true"], e["plain_true"])
    row("exec `sh -c 'echo hi'`, warm", e["sandbox_sh_echo"], e["plain_sh_echo"])
    for conc, v in r["per_second"].items():
        print(
            f"| create+exec+close per second, concurrency {conc} | "
            f"{v['sandboxes_per_s']:.1f}/s | {v['plain_per_s']:.0f}/s | "
            f"{v['plain_per_s'] / v['sandboxes_per_s']:.0f}x |"
        )
    p = r["peak"]
    print(
        f"\npeak: {p['opened']} sandboxes open at once ({p['working']} ran a command; stopped by "
        f"{p['stopped_by']}); opened in {p['open_s']:.1f} s, closed in {p['close_all_s']:.1f} s; "
        f"per sandbox: {p['processes_per_sandbox']:.1f} host processes, "
        f"{p['pss_kb_per_sandbox'] / 1024:.2f} MiB PSS, "
        f"{p['cgroup_kb_per_sandbox'] / 1024:.2f} MiB charged to its memory cgroup; "
        f"as many plain sleeps: "
        f"{p['pss_kb_plain_per_sandbox'] / 1024:.2f} MiB PSS"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-create", type=int, default=20, help="sandboxes for create latency")
    ap.add_argument("--n-exec", type=int, default=100, help="execs for the round trip")
    ap.add_argument("--n-rate", type=int, default=40, help="sandboxes per throughput run")
    ap.add_argument("--peak", type=int, default=200, help="most sandboxes held at once")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    res = asyncio.run(main(a))
    _report(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
