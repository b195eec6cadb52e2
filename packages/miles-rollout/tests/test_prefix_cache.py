"""The prefix cache: radix-tree bookkeeping, exact logprobs on a hit, invalidation, eviction."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from miles_rollout import Engine, EngineConfig, SamplingParams, serve
from miles_rollout._prefix_cache import RadixCache

Teacher = Callable[[list[int], list[int], float], list[float]]
LOGPROB_TOL = 1e-5
BF16_LOGPROB_TOL = 2e-2


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 100 + 3 for i in range(n)]


def _state(engine: Engine) -> dict[str, Any]:
    return engine.server_info()["internal_states"][0]


@pytest.fixture(scope="module")
def cached(model_dir: Path) -> Iterator[Engine]:
    with EngineConfig(model_path=str(model_dir), max_running_requests=16).build() as eng:
        yield eng


@pytest.fixture(scope="module")
def uncached(model_dir: Path) -> Iterator[Engine]:
    cfg = EngineConfig(
        model_path=str(model_dir), max_running_requests=16, enable_prefix_cache=False
    )
    with cfg.build() as eng:
        yield eng


# ---- the tree ------------------------------------------------------------------------------


def _writes() -> tuple[list[tuple[int, list[int]]], Callable[[int, torch.Tensor], None]]:
    log: list[tuple[int, list[int]]] = []
    return log, lambda start, slots: log.append((start, slots.tolist()))


def test_radix_tree_matches_splits_and_evicts_least_recently_used() -> None:
    tree = RadixCache(capacity=10)
    log, write = _writes()
    assert tree.insert([1, 2, 3, 4], write) == 4
    assert log == [(0, [0, 1, 2, 3])]
    # A shared prefix is stored once: only the new suffix is written (the edge is split).
    assert tree.insert([1, 2, 9, 9], write) == 2
    assert log[-1] == (2, [4, 5])
    n, slots = tree.match([1, 2, 3, 7])
    assert (n, slots.tolist()) == (3, [0, 1, 2])
    assert tree.match([1, 2, 9, 9, 5])[0] == 4
    assert tree.match([5, 1])[0] == 0
    assert tree.insert([1, 2, 3, 4], write) == 0  # already cached
    assert tree.stats.cached_tokens == 6
    # Touch [1, 2, 3, 4]; then a 6-token insert (4 slots free) must evict the least recently
    # used leaf ([9, 9]) and nothing on the path it extends.
    tree.match([1, 2, 3, 4])
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], write) == 6
    assert tree.stats.evicted_tokens == 2
    assert tree.match([1, 2, 9, 9])[0] == 2
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])[0] == 10
    assert tree.free_slots == 0
    # A full pool whose only leaf is on the insert path: the insert is cut to what fits.
    assert tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], write) == 0
    assert tree.insert([7, 7, 7], write) == 3  # evicts the long leaf (least recent)
    tree.flush()
    assert tree.stats.cached_tokens == 0
    assert tree.stats.flushes == 1
    assert tree.match([1, 2])[0] == 0
    with pytest.raises(ValueError, match="capacity"):
        RadixCache(0)


# ---- exactness -----------------------------------------------------------------------------


def test_second_turn_hits_the_cache_with_bit_identical_logprobs(
    cached: Engine, uncached: Engine, teacher_logprobs: Teacher
) -> None:
    """Turn 2 = turn 1's prompt + output + new tokens: its prefix comes from the cache, and
    its tokens and logprobs equal, bit for bit, those of an engine without a cache that runs
    the whole prompt beside other requests (float32: the engine is batch invariant)."""
    p1 = _prompt(23)
    params = SamplingParams(temperature=1.0, max_new_tokens=17, ignore_eos=True, seed=5)
    turn1 = cached.generate(p1, params)
    assert turn1.cached_tokens == 0
    p2 = p1 + turn1.output_ids + _prompt(9, 40)
    before = _state(cached)["num_prefill_tokens"]
    turn2 = cached.generate(p2, params)
    # Every token but turn 1's last output (never fed to the model) came from the cache.
    assert turn2.cached_tokens == len(p1) + len(turn1.output_ids) - 1
    assert _state(cached)["num_prefill_tokens"] - before == len(p2) - turn2.cached_tokens

    others = [
        uncached.submit(_prompt(5 + 7 * k, k), SamplingParams(max_new_tokens=25, seed=k))
        for k in range(3)
    ]
    miss = uncached.generate(p2, params)
    for f in others:
        f.result()
    assert miss.cached_tokens == 0
    assert turn2.output_logprobs is not None
    assert miss.output_logprobs is not None
    ref = teacher_logprobs(p2, turn2.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(turn2.output_logprobs, ref)) < LOGPROB_TOL
    if not cached._runner.batch_invariant:
        pytest.skip("float32 batch invariance needs the native attention kernel")
    assert turn2.output_ids == miss.output_ids
    assert turn2.output_logprobs == miss.output_logprobs  # bit for bit


def test_group_samples_share_a_cached_prompt_exactly(cached: Engine, uncached: Engine) -> None:
    """n samples of one prompt (a GRPO group) admitted together after a cached prefix."""
    system = _prompt(30, 11)
    cached.generate([*system, 5], SamplingParams(max_new_tokens=1))
    prompt = system + _prompt(6, 70)
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, seed=s) for s in range(4)]
    cached.pause_generation("in_place")  # so that the whole group is admitted together
    try:
        futs = [cached.submit(prompt, p) for p in params]
    finally:
        cached.continue_generation()
    outs = [f.result() for f in futs]
    assert [o.cached_tokens for o in outs] == [len(system)] * 4
    ref = [uncached.generate(prompt, p) for p in params]
    assert len({tuple(o.output_ids) for o in outs}) > 1
    if cached._runner.batch_invariant:
        assert [o.output_logprobs for o in outs] == [r.output_logprobs for r in ref]


def test_bf16_cache_hit_stays_within_tolerance(model_dir: Path) -> None:
    """bf16 is not batch invariant (oneDNN GEMMs round by shape): a hit's logprobs match a
    miss's within the bf16 tolerance (measured: equal on this model)."""
    p1 = _prompt(21, 3)
    params = SamplingParams(temperature=0.8, max_new_tokens=14, ignore_eos=True, seed=9)
    path = str(model_dir)
    with (
        EngineConfig(model_path=path, dtype="bfloat16").build() as eng,
        EngineConfig(model_path=path, dtype="bfloat16", enable_prefix_cache=False).build() as ref,
    ):
        turn1 = eng.generate(p1, params)
        p2 = p1 + turn1.output_ids + _prompt(5, 60)
        hit = eng.generate(p2, params)
        miss = ref.generate(p2, params)
    assert hit.cached_tokens == len(p1) + 13
    assert hit.output_ids == miss.output_ids
    assert hit.output_logprobs is not None
    assert miss.output_logprobs is not None
    worst = max(abs(a - b) for a, b in zip(hit.output_logprobs, miss.output_logprobs))
    assert worst < BF16_LOGPROB_TOL


# ---- invalidation and eviction -------------------------------------------------------------


def test_weight_update_drops_the_cache_and_in_flight_kv_never_enters_it(
    model_dir: Path, model_dir_v2: Path
) -> None:
    from safetensors.torch import load_file

    new = list(load_file(str(model_dir_v2 / "model.safetensors")).items())
    old = list(load_file(str(model_dir / "model.safetensors")).items())
    prompt = _prompt(40, 5)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1)
    with EngineConfig(model_path=str(model_dir)).build() as eng:
        eng.generate(prompt, params)
        assert eng.generate(prompt, params).cached_tokens == len(prompt) - 1
        # flush_cache=False keeps the (now stale) entries, as SGLang does.
        eng.update_weights_from_tensor(old, weight_version="same", flush_cache=False)
        assert eng.generate(prompt, params).cached_tokens == len(prompt) - 1
        eng.update_weights_from_tensor(new, weight_version="v2")
        after = eng.generate(prompt, params)
        assert after.cached_tokens == 0
        assert _state(eng)["prefix_cache_flushes"] == 1
        # A request in flight across an update finishes, but its mixed KV is not cached.
        long = eng.submit(_prompt(20, 9), SamplingParams(max_new_tokens=80, ignore_eos=True))
        deadline = time.monotonic() + 20
        while not _state(eng)["num_running_reqs"]:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        eng.update_weights_from_tensor(old, weight_version="v3")
        out = long.result(timeout=30)
        assert set(out.output_weight_versions or []) <= {"v2", "v3"}
        tokens = _prompt(20, 9) + out.output_ids
        assert eng.generate(tokens, params).cached_tokens == 0
    with EngineConfig(model_path=str(model_dir_v2)).build() as fresh:
        want = fresh.generate(prompt, params)
    assert after.output_ids == want.output_ids
    assert after.output_logprobs is not None
    assert want.output_logprobs is not None
    assert max(abs(a - b) for a, b in zip(after.output_logprobs, want.output_logprobs)) < 1e-5


def test_small_cache_evicts_and_stays_exact(model_dir: Path, teacher_logprobs: Teacher) -> None:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, seed=2)
    cfg = EngineConfig(model_path=str(model_dir), prefix_cache_tokens=48)
    with cfg.build() as eng:
        prompts = [_prompt(30, 13 * k) for k in range(4)]
        for p in prompts:
            eng.generate(p, params)
        state = _state(eng)
        assert state["prefix_cache_tokens"] <= 48
        assert state["prefix_cache_evicted_tokens"] > 0
        # The most recent prompt survived, the oldest did not.
        again = eng.generate(prompts[-1], params)
        assert again.cached_tokens == len(prompts[-1]) - 1
        assert eng.generate(prompts[0], params).cached_tokens == 0
    assert again.output_logprobs is not None
    ref = teacher_logprobs(prompts[-1], again.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(again.output_logprobs, ref)) < LOGPROB_TOL


def test_retracted_requests_resume_from_the_cache(model_dir: Path) -> None:
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True, seed=s) for s in range(3)]
    prompts = [_prompt(25, 31 * k) for k in range(3)]
    with EngineConfig(model_path=str(model_dir)).build() as eng:
        reference = [eng.generate(p, sp) for p, sp in zip(prompts, params)]
        eng.flush_cache()
        futs = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
        deadline = time.monotonic() + 20
        while _state(eng)["num_running_reqs"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        eng.pause_generation("retract")
        before = _state(eng)["num_prefill_tokens"]
        eng.continue_generation()
        outs = [f.result(timeout=30) for f in futs]
        # Each re-prefill ran only the one token whose KV did not exist yet.
        assert _state(eng)["num_prefill_tokens"] - before == 3
    for out, ref in zip(outs, reference):
        assert out.cached_tokens == 0  # counted at first admission only, as SGLang
        assert out.output_ids == ref.output_ids
        if eng._runner.batch_invariant:
            assert out.output_logprobs == ref.output_logprobs


# ---- counters over HTTP --------------------------------------------------------------------


def test_hit_counters_in_server_info_and_prometheus_metrics(model_dir: Path) -> None:
    import asyncio

    prompt = _prompt(33, 2)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=4)
    with EngineConfig(model_path=str(model_dir)).build() as eng, serve(eng) as handle:
        eng.generate(prompt, params)
        eng.generate(prompt, params)

        async def fetch() -> tuple[dict[str, Any], str, int]:
            async with aiohttp.ClientSession() as s:
                async with s.get(handle.url + "/get_server_info") as r:
                    info = await r.json()
                async with s.get(handle.url + "/metrics") as r:
                    text = await r.text()
                async with s.post(handle.url + "/flush_cache") as r:
                    status = r.status
            return info, text, status

        info, text, status = asyncio.run(fetch())
        assert status == 200
        assert _state(eng)["prefix_cache_tokens"] == 0
    state = info["internal_states"][0]
    assert state["num_prompt_tokens"] == 2 * len(prompt)
    assert state["num_cached_prompt_tokens"] == len(prompt) - 1
    assert state["cache_hit_rate"] == (len(prompt) - 1) / (2 * len(prompt))
    assert state["prefix_cache_tokens"] == len(prompt) + 2
    assert f'sglang:cached_tokens_total{{dp_rank="0"}} {float(len(prompt) - 1)}' in text
    assert "# TYPE sglang:cache_hit_rate gauge" in text
    assert 'miles_rollout:prefix_cache_capacity_tokens{dp_rank="0"}' in text
