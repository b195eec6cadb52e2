"""Data-parallel ranks in one engine / server: rank choice, affinity, load, and control on all."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router_launch import launch_router, stop_router

from miles_rollout import Engine, EngineConfig, SamplingParams, SGLangClient, serve

ROUTER = os.environ.get("MILES_SGLANG_ROUTER") or shutil.which(
    "sglang-router", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
)


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bytes(resp.read())
    except OSError:
        return b""


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 100 + 3 for i in range(n)]


def _tokens(engine: Engine) -> list[int]:
    return [st["num_generated_tokens"] for st in engine.server_info()["internal_states"]]


@pytest.fixture(scope="module")
def dp2(model_dir: Path) -> Iterator[Engine]:
    cfg = EngineConfig(model_path=str(model_dir), dp_size=2, num_threads=1)
    with cfg.build() as eng:
        yield eng


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def _both_running(eng: Engine, futs: list[Any]) -> bool:
    """Wait until every rank is running a request (True) or one of ``futs`` is done (False)."""
    deadline = time.monotonic() + 60
    while not all(st["num_running_reqs"] for st in eng.server_info()["internal_states"]):
        if any(f.done() for f in futs):
            return False
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.002)
    return True


def test_requests_run_on_the_rank_they_name_with_identical_bits(dp2: Engine) -> None:
    info = dp2.server_info()
    assert info["dp_size"] == 2
    assert [st["dp_rank"] for st in info["internal_states"]] == [0, 1]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True, seed=3)
    outs = []
    for rank in (0, 1):
        before = _tokens(dp2)
        outs.append(dp2.generate(_prompt(12), params, data_parallel_rank=rank))
        grew = [a - b for a, b in zip(_tokens(dp2), before)]
        assert grew == ([9, 0] if rank == 0 else [0, 9])
    assert outs[0].output_ids == outs[1].output_ids
    if dp2._runner.batch_invariant:
        assert outs[0].output_logprobs == outs[1].output_logprobs


def test_a_rank_that_does_not_exist_is_a_clear_error(dp2: Engine) -> None:
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match=r"data_parallel_rank .* does not exist.*dp_size 2"):
            dp2.submit([1, 2, 3], data_parallel_rank=bad)  # type: ignore[arg-type]
    assert dp2.generate([1, 2], SamplingParams(max_new_tokens=2)).completion_tokens == 2


def test_sessions_stick_to_a_rank_and_new_work_goes_to_the_least_loaded(dp2: Engine) -> None:
    long = SamplingParams(max_new_tokens=100, ignore_eos=True, seed=1)
    busy = dp2.submit(_prompt(5), long, data_parallel_rank=0)
    _wait(lambda: dp2.load()[0]["num_reqs"] == 1, "rank 0 never got its request")
    # Nothing names a rank: the least loaded rank (1) takes the session's first turn...
    p1 = _prompt(30, 4)
    turn = SamplingParams(max_new_tokens=5, ignore_eos=True, seed=2)
    before = _tokens(dp2)
    first = dp2.generate(p1, turn, routing_key="sess-x")
    assert [a - b for a, b in zip(_tokens(dp2), before)][1] == 5
    busy.result(timeout=30)
    # ...and its second turn follows it there although both ranks are idle now, so it hits
    # the prefix cached by the first turn.
    assert dp2.load()[1]["num_reqs"] == 0
    before = _tokens(dp2)
    second = dp2.generate(p1 + first.output_ids + [9, 9], turn, routing_key="sess-x")
    assert [a - b for a, b in zip(_tokens(dp2), before)] == [0, 5]
    assert second.cached_tokens == len(p1) + 4


def test_pause_updates_and_flush_apply_to_every_rank(model_dir: Path, model_dir_v2: Path) -> None:
    from safetensors.torch import load_file

    new = list(load_file(str(model_dir_v2 / "model.safetensors")).items())
    params = SamplingParams(max_new_tokens=70, ignore_eos=True, seed=4)
    with EngineConfig(model_path=str(model_dir), dp_size=2, num_threads=1).build() as eng:
        # Both ranks must be mid-request at the pause. On a loaded machine one rank can finish
        # its 70 tokens before the other's thread starts: then try again with new requests.
        for _ in range(20):
            futs = [eng.submit(_prompt(6, r), params, data_parallel_rank=r) for r in (0, 1)]
            if _both_running(eng, futs):
                break
            for f in futs:
                f.result(timeout=60)
        else:
            pytest.fail("the two ranks never decoded at the same time in 20 tries")
        eng.pause_generation("in_place")
        assert all(st["paused"] for st in eng.server_info()["internal_states"])
        generated = _tokens(eng)
        assert eng.flush_cache() is False  # requests in flight on both ranks
        eng.update_weights_from_tensor(new, weight_version="v2")
        time.sleep(0.05)
        assert _tokens(eng) == generated  # still paused on both
        eng.continue_generation()
        outs = [f.result(timeout=30) for f in futs]
        for out in outs:
            versions = out.output_weight_versions or []
            assert versions[0] == "0"
            assert versions[-1] == "v2"
        assert eng.flush_cache() is True
        after = [eng.generate(_prompt(8), params, data_parallel_rank=r) for r in (0, 1)]
        assert eng.abort_request("nope") == 0
    with EngineConfig(model_path=str(model_dir_v2)).build() as ref_eng:
        ref = ref_eng.generate(_prompt(8), params)
    assert ref.output_logprobs is not None
    for out in after:
        assert out.weight_version == "v2"
        assert out.output_ids == ref.output_ids
        assert out.output_logprobs is not None
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref.output_logprobs)) < 1e-5


def test_http_rank_field_load_and_bad_rank(dp2: Engine) -> None:
    async def main() -> None:
        with serve(dp2) as handle:
            async with aiohttp.ClientSession() as s:
                body: dict[str, Any] = {
                    "input_ids": [5, 6, 7],
                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                    "data_parallel_rank": 1,
                }
                before = _tokens(dp2)
                async with s.post(handle.url + "/generate", json=body) as r:
                    assert r.status == 200
                assert [a - b for a, b in zip(_tokens(dp2), before)] == [0, 3]
                for bad, msg in ((5, "does not exist"), ("x", "non-negative integer")):
                    async with s.post(
                        handle.url + "/generate", json={**body, "data_parallel_rank": bad}
                    ) as r:
                        assert r.status == 400
                        assert msg in (await r.json())["error"]["message"]
                async with s.get(handle.url + "/get_load") as r:
                    load = await r.json()
                assert [x["dp_rank"] for x in load] == [0, 1]
                async with s.get(handle.url + "/server_info") as r:
                    assert (await r.json())["dp_size"] == 2
                async with s.get(handle.url + "/metrics") as r:
                    text = await r.text()
                assert 'sglang:num_running_reqs{dp_rank="1"}' in text
            async with SGLangClient(handle.url) as c:
                out = await c.generate([5, 6], {"max_new_tokens": 2}, data_parallel_rank=0)
                assert out.completion_tokens == 2

    asyncio.run(main())


def test_cli_serves_dp_ranks(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    from miles_rollout.cli import main

    stop = threading.Event()
    argv = ["serve", "--model-path", str(model_dir), "--port", "0", "--dp-size", "2"]
    argv += ["--num-threads", "1"]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(argv, stop=stop)))
    thread.start()
    try:
        # The server binds port 0 and prints its URL once it serves.
        printed = ""
        deadline = time.monotonic() + 60
        while " at http://" not in printed:
            assert time.monotonic() < deadline
            assert thread.is_alive()
            time.sleep(0.05)
            printed += capsys.readouterr().out
        url = printed.split(" at ", 1)[1].split()[0]
        assert json.loads(_get(f"{url}/get_server_info"))["dp_size"] == 2
    finally:
        stop.set()
        thread.join(timeout=30)
    assert result == [0]


@pytest.mark.slow
@pytest.mark.skipif(ROUTER is None, reason="sglang-router is not installed")
def test_router_dp_aware_sends_each_session_to_one_rank(model_dir: Path) -> None:
    """sglang-router --dp-aware registers each rank as a worker and names it in the body."""
    assert ROUTER is not None
    with EngineConfig(model_path=str(model_dir), dp_size=2, num_threads=1).build() as eng:
        handle = serve(eng)
        args = ["--worker-urls", handle.url, "--policy", "manual", "--assignment-mode"]
        args += ["min_load", "--dp-aware", "--log-level", "warn"]
        proc, url = launch_router(
            ROUTER, args, lambda u: _get(u + "/workers").count(b'"is_healthy":true') >= 2
        )
        try:

            async def main() -> tuple[list[list[int]], list[int]]:
                grew_per_key = []
                async with SGLangClient(url, timeout=60) as c:
                    # Affinity: both turns of a session land on one rank.
                    for key in ("a", "b", "c", "d"):
                        before = _tokens(eng)
                        for _ in range(2):
                            params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=1)
                            await c.generate([5, 6, 7], params, routing_key=key)
                        grew_per_key.append([x - y for x, y in zip(_tokens(eng), before)])
                    # Spread: new sessions arriving together go to the least loaded rank, so
                    # both ranks get some (one at a time, min_load's ties may pick either).
                    before = _tokens(eng)
                    long = SamplingParams(max_new_tokens=32, ignore_eos=True, seed=1)
                    await asyncio.gather(
                        *(c.generate([5, 6, 7], long, routing_key=f"new{i}") for i in range(4))
                    )
                    spread = [x - y for x, y in zip(_tokens(eng), before)]
                return grew_per_key, spread

            grew, spread = asyncio.run(main())
        finally:
            stop_router(proc)
            handle.close()
    for g in grew:
        assert sorted(g) == [0, 8], f"a session's turns went to both ranks: {grew}"
    assert sum(spread) == 4 * 32
    assert all(n > 0 for n in spread), f"concurrent new sessions all went to one rank: {spread}"
