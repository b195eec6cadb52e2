"""A real fleet: engine processes behind the real sglang-router 0.3.2 (skipped without it).

The shared fleet has 2 engines x 2 DP ranks: the router sees 4 workers (``url@rank``). Where a
request ran is read from the engines themselves: each engine gets its own weight version
(``e0``, ``e1``, ...; ``/update_weight_version`` sent to it directly), which it reports in every
response; each DP rank has its own prefix cache, so ``cached_tokens`` covering the session's
previous turn shows the turn ran on the same rank; ``/get_load`` and ``/get_server_info`` give
per-rank requests and token counters, which must add up to what the responses say.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from miles_rollout import GenerateOutput, SamplingParams, SGLangClient, SGLangHTTPError
from miles_rollout.fleet import Fleet, FleetConfig
from miles_rollout.fleet.processes import wait_gone
from miles_rollout.fleet.router import find_router

try:
    find_router()
    HAVE_ROUTER = True
except FileNotFoundError:
    HAVE_ROUTER = False

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_ROUTER, reason="sglang-router is not installed"),
]


# Every fleet here runs with an API key: the router demands it and sends it on to the engines.
KEY = "fleet-test-key"


def _get(url: str, key: str | None = KEY) -> object:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _counter(url: str, name: str) -> int:
    info = _get(url + "/get_server_info")
    assert isinstance(info, dict)
    return sum(s[name] for s in info["internal_states"])


def _rank_loads(url: str) -> list[int]:
    loads = _get(url + "/get_load")
    assert isinstance(loads, list)
    return [int(r["num_reqs"]) for r in sorted(loads, key=lambda r: r["dp_rank"])]


def _healthy_workers(router_url: str) -> set[str]:
    workers = _get(router_url + "/workers")
    assert isinstance(workers, dict)
    return {w["url"] for w in workers["workers"] if w["is_healthy"]}


def _load(url: str) -> int:
    return sum(_rank_loads(url))


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _until_held(urls: list[str], n: int) -> None:
    """Wait until the engines at ``urls`` hold ``n`` requests in all."""
    await _until(lambda: sum(_load(u) for u in urls) == n, f"{n} requests held")


def _params(n: int = 4, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, seed=seed)


async def _tag(fleet: Fleet) -> dict[str, int]:
    """Give each live engine the weight version ``e<index>``; return tag -> index."""
    tags = {}
    for e in fleet.engines:
        if e.alive:
            async with SGLangClient(e.url, api_key=KEY) as c:
                await c.update_weight_version(f"e{e.index}")
            tags[f"e{e.index}"] = e.index
    return tags


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cfg = FleetConfig(
        model_path=str(model_dir),
        engines=2,
        dp_size=2,
        engine_args={"num_threads": 1},  # each rank one thread
        replace_dead_engines=True,
        log_dir=str(tmp_path_factory.mktemp("fleet-logs")),
        startup_timeout_s=300,
        api_key=KEY,
    )
    with cfg.build() as f:
        asyncio.run(_tag(f))
        yield f
    assert wait_gone(f.pids, 30) == [], "close() left processes running"


def test_router_and_engines_demand_the_key(fleet: Fleet) -> None:
    """The real sglang-router with --api-key registered the engines (it sends the key on) and
    refuses clients without it; the engines refuse direct calls without it too."""
    for url in [fleet.url + "/generate", *(e.url + "/get_server_info" for e in fleet.engines)]:
        for key in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as info:
                _get(url, key)
            assert info.value.code == 401, url
    for e in fleet.engines:
        assert _counter(e.url, "num_running_reqs") >= 0  # with the key: answered


def test_sessions_stick_to_one_engine_and_rank_under_load(fleet: Fleet) -> None:
    """8 concurrent sessions x 4 turns of growing prompts, each session its own routing key."""
    urls = {f"e{e.index}": e.url for e in fleet.engines}
    counters = ("num_generated_tokens", "num_cached_prompt_tokens")
    before = {(t, n): _counter(u, n) for t, u in urls.items() for n in counters}

    async def session(s: int, client: SGLangClient) -> list[tuple[int, GenerateOutput]]:
        ids, turns = [10 + s, 40 + s, 70 + s, 11, 12, 13], []
        for turn in range(4):
            out = await client.generate(
                ids, _params(seed=10 * s + turn), rid=f"s{s}-t{turn}", routing_key=f"load-{s}"
            )
            turns.append((len(ids), out))
            ids = ids + out.output_ids + [20 + turn, 21 + turn]  # a tool result, then the next turn
        return turns

    async def main() -> list[list[tuple[int, GenerateOutput]]]:
        async with SGLangClient(fleet.url, timeout=120, api_key=KEY) as c:
            return list(await asyncio.gather(*(session(s, c) for s in range(8))))

    sessions = asyncio.run(main())
    served: Counter[tuple[str, str]] = Counter()
    for s, turns in enumerate(sessions):
        outs = [o for _, o in turns]
        assert len({o.weight_version for o in outs}) == 1, f"session {s} changed engines"
        assert [o.rid for o in outs] == [f"s{s}-t{t}" for t in range(4)]
        # The rank's own prefix cache held the whole previous prompt: the same DP rank.
        for (prev_len, _), (_, out) in itertools.pairwise(turns):
            assert out.cached_tokens >= prev_len, f"session {s} changed DP ranks"
        for o in outs:
            served[(o.weight_version, "num_generated_tokens")] += o.completion_tokens
            served[(o.weight_version, "num_cached_prompt_tokens")] += o.cached_tokens
    # The engines' own counters agree with what their responses say they served.
    grew = {(t, n): _counter(urls[t], n) - v for (t, n), v in before.items()}
    assert grew == {key: served[key] for key in before}
    assert sum(served[(t, "num_generated_tokens")] for t in urls) == 8 * 4 * 4


def test_each_new_session_goes_to_an_idle_rank(fleet: Fleet) -> None:
    """With both engines paused, four new sessions in a row: each goes to a (engine, rank) with
    nothing in flight (manual / min_load), so every one of the 4 workers holds exactly one."""
    engines = list(fleet.engines)

    def loads() -> list[int]:
        return [n for e in engines for n in _rank_loads(e.url)]

    async def main() -> None:
        async with SGLangClient(fleet.url, timeout=120, api_key=KEY) as c:
            directs = [SGLangClient(e.url, api_key=KEY) for e in engines]
            for d in directs:
                await d.pause_generation("in_place")
            held = []
            try:
                for i in range(4):
                    held.append(
                        asyncio.create_task(
                            c.generate([8, 9, i], _params(2), routing_key=f"new-{i}")
                        )
                    )
                    await _until_held([e.url for e in engines], i + 1)
                    assert sorted(loads(), reverse=True) == [1] * (i + 1) + [0] * (3 - i)
            finally:
                for d in directs:
                    await d.continue_generation()
                    await d.close()
            outs = await asyncio.gather(*held)
        assert Counter(o.weight_version for o in outs) == {"e0": 2, "e1": 2}

    asyncio.run(main())


def _retriable(exc: BaseException) -> bool:
    """A failure a client may retry: a 5xx from the router or a dropped connection."""
    if isinstance(exc, SGLangHTTPError):
        return exc.status >= 500
    return isinstance(exc, aiohttp.ClientError)


async def _turn_with_retries(
    c: SGLangClient, ids: list[int], key: str, deadline_s: float = 90.0
) -> GenerateOutput:
    """What a session client does: retry a turn after a retriable failure."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return await c.generate(ids, _params(2), routing_key=key)
        except (SGLangHTTPError, aiohttp.ClientError) as exc:
            error: BaseException = exc
        assert _retriable(error), error
        assert time.monotonic() < deadline, f"{key} never got through: {error}"
        await asyncio.sleep(0.5)


def test_engine_death_moves_its_sessions_and_a_replacement_joins(fleet: Fleet) -> None:
    by_tag = {f"e{e.index}": e for e in fleet.engines}

    async def main() -> None:
        async with SGLangClient(fleet.url, timeout=120, api_key=KEY) as c:
            keys: dict[str, list[str]] = {t: [] for t in by_tag}
            for i in range(6):
                out = await c.generate([30, 31, i], _params(2), routing_key=f"doomed-{i}")
                keys[out.weight_version].append(f"doomed-{i}")
            victim_tag = next(t for t, k in keys.items() if k)
            victim = by_tag[victim_tag]
            survivor = next(e for t, e in by_tag.items() if t != victim_tag)
            # Two turns in flight on the victim (paused in place), then it dies.
            async with SGLangClient(victim.url, api_key=KEY) as direct:
                await direct.pause_generation("in_place")
            in_flight = [
                asyncio.create_task(c.generate([30, 31, 9], _params(2), routing_key=k))
                for k in keys[victim_tag][:2]
            ]
            await _until(lambda: _load(victim.url) >= len(in_flight), "turns in flight")
            # The fleet's monitor has seen the victim's cache filled (it polls every 2 s).
            await _until(lambda: victim.last_stats.get("prefix_cache_tokens", 0) > 0, "a poll")
            os.kill(victim.pid, signal.SIGKILL)

            # Nothing hangs: each in-flight turn ends, re-run elsewhere or as a retriable error.
            ends = await asyncio.wait_for(asyncio.gather(*in_flight, return_exceptions=True), 90)
            for end in ends:
                if isinstance(end, BaseException):
                    assert _retriable(end), end
                else:
                    assert end.weight_version == f"e{survivor.index}"
            # The victim's sessions carry on on the survivor and stay there.
            for k in keys[victim_tag]:
                out = await _turn_with_retries(c, [30, 31, 7], k)
                assert out.weight_version == f"e{survivor.index}"
                again = await c.generate([30, 31, 7, 1], _params(2), routing_key=k)
                assert again.weight_version == f"e{survivor.index}"
            for k in keys[f"e{survivor.index}"]:  # the survivor's own sessions never moved
                out = await c.generate([30, 31, 8], _params(2), routing_key=k)
                assert out.weight_version == f"e{survivor.index}"

            # The fleet reported the death and the moved sessions.
            await _until(
                lambda: any(ev.kind == "engine_died" for ev in fleet.events), "engine_died"
            )
            died = next(ev for ev in fleet.events if ev.kind == "engine_died")
            assert died.engine == victim.index
            assert died.detail["status"] == -signal.SIGKILL
            lost = victim.last_stats["prefix_cache_tokens"]
            assert died.detail["cache_tokens_lost"] == lost > 0
            assert f"the {lost:g} tokens its prefix cache held" in died.message
            await _until(lambda: fleet.metrics()["fleet/sessions_moved"] >= 1, "sessions_moved")
            m = fleet.metrics()
            assert m["fleet/engine_deaths"] == 1
            assert m["fleet/engines_alive"] == 1
            assert m["fleet/cache_tokens_lost"] == lost

            # The router takes the dead engine's ranks out; the fleet starts a replacement
            # (replace_dead_engines) that joins the router; with the live engines paused, four
            # new sessions fill the four live (engine, rank) workers.
            dead = {f"{victim.url}@{r}" for r in range(2)}
            await _until(lambda: not dead & _healthy_workers(fleet.url), "dead ranks marked down")
            await _until(
                lambda: any(ev.kind == "engine_added" for ev in fleet.events), "a replacement"
            )
            new = fleet.engines[-1]
            assert new.index == 2
            assert fleet.engine_urls == [survivor.url, new.url]
            assert {f"{new.url}@{r}" for r in range(2)} <= _healthy_workers(fleet.url)
            await _tag(fleet)
            live = [survivor, new]
            directs = [SGLangClient(e.url, api_key=KEY) for e in live]
            for d in directs:
                await d.pause_generation("in_place")
            held = []
            try:
                for i in range(4):
                    held.append(
                        asyncio.create_task(
                            c.generate([30, 31, i], _params(2), routing_key=f"after-join-{i}")
                        )
                    )
                    await _until_held([e.url for e in live], i + 1)
                assert _rank_loads(new.url) == [1, 1]
            finally:
                for d in directs:
                    await d.continue_generation()
                    await d.close()
            outs = await asyncio.gather(*held)
            assert Counter(o.weight_version for o in outs) == {f"e{survivor.index}": 2, "e2": 2}

    asyncio.run(main())


def _start_cli(argv: list[str], log: Path) -> tuple[subprocess.Popen[str], str, list[int]]:
    """Run ``miles-rollout fleet``; return it, the router URL and the PIDs it printed."""
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles_rollout.cli", "fleet", *argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    lines: queue.Queue[str | None] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)
        lines.put(None)  # the fleet exited

    threading.Thread(target=read, daemon=True).start()
    pids: list[int] = []
    deadline = time.monotonic() + 300
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            raise AssertionError(f"the fleet never printed its URL:\n{log.read_text()[-3000:]}")
        pids += [int(p) for p in re.findall(r"\(pid (\d+)\)", line)]
        m = re.search(r" at (http://\S+)$", line.strip())
        if m and "fleet of" in line:
            return proc, m.group(1), pids


def _generate_once(url: str) -> GenerateOutput:
    async def main() -> GenerateOutput:
        async with SGLangClient(url, timeout=120, api_key=KEY) as c:
            return await c.generate([5, 6, 7], _params(2), routing_key="cli")

    return asyncio.run(main())


def test_cli_fleet_stops_every_child_on_sigterm(model_dir: Path, tmp_path: Path) -> None:
    base = ["--model-path", str(model_dir), "--router-port", "0", "--log-dir", str(tmp_path)]
    base += ["--api-key", KEY]
    proc, url, pids = _start_cli(
        [*base, "--engine-num-threads", "1"],
        tmp_path / "fleet.err",
    )
    try:
        assert len(pids) == 2  # one engine, the router
        assert _generate_once(url).completion_tokens == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert wait_gone(pids, 30) == []


def test_cli_fleet_killed_outright_takes_its_children_along(
    model_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL leaves the fleet no chance to clean up: PDEATHSIG does. Also the 'command'
    backend, with our own server as the command."""
    command = (
        f"{sys.executable} -m miles_rollout.cli serve --model-path {model_dir} "
        "--host {host} --port {port} --num-threads 1"
    )
    base = ["--model-path", str(model_dir), "--router-port", "0", "--log-dir", str(tmp_path)]
    base += ["--api-key", KEY]
    proc, url, pids = _start_cli(
        [*base, "--backend", "command", "--command", command],
        tmp_path / "fleet.err",
    )
    try:
        assert len(pids) == 2
        assert _generate_once(url).completion_tokens == 2
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(pids, 30) == []
