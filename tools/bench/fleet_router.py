"""The fleet's router: what it costs per request, and what session affinity buys in cache hits.

Why: every rollout request of a fleet goes through sglang-router. Two questions, each measured
against a named limit in the same run:

1. ``overhead``: latency of one short request (prompt 8, 1 new token) sent to the engine
   directly vs through the router in front of it (the limit: the direct call), sequential,
   direct and routed requests interleaved so drift hits both; plus throughput with 32 clients
   in flight.
2. ``hit-rate``: a multi-turn workload (``--sessions`` x ``--turns``; each turn's prompt is the
   previous prompt + the previous output + a new tool result) on 2 engines with prefix caches,
   routed by session key (``manual`` / ``min_load``, the fleet's default) vs ``round_robin``
   through the same router binary. Reported: cached prompt tokens (``meta_info.cached_tokens``)
   / reusable prompt tokens (the part of each prompt the same session sent or received before;
   the limit: 100%).

A random ~1M-parameter Qwen3 built from a config (context 1024), 2 embedded engines with one
thread each, the real sglang-router 0.3.2.

Laptop:   python tools/bench/fleet_router.py                   # ~2 min on 2 cores
          python tools/bench/fleet_router.py --only hit-rate --sessions 32 --turns 6
Cluster:  the same script with ``--backend sglang --model-path DIR`` measures SGLang engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


def build_model(path: Path) -> Path:
    """A random 2-layer Qwen3 (hidden 128, vocab 512, context 1024), no tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def _fleet_config(args: argparse.Namespace, model: str, engines: int, policy: str) -> Any:
    from miles_rollout.fleet import FleetConfig

    router_args = {} if policy == "manual" else {"policy": policy}
    if args.backend == "sglang":
        return FleetConfig(
            model_path=model, engines=engines, backend="sglang", router_args=router_args
        )
    return FleetConfig(
        model_path=model, engines=engines, engine_args={"num_threads": 1}, router_args=router_args
    )


def overhead(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from miles_rollout import SamplingParams, SGLangClient

    params = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    prompt = list(range(10, 18))

    async def run(direct_url: str, router_url: str) -> dict[str, Any]:
        lat: dict[str, list[float]] = {"direct": [], "router": []}
        async with SGLangClient(direct_url) as d, SGLangClient(router_url) as r:
            for _ in range(20):  # warm up both paths (connections, first prefill)
                await d.generate(prompt, params)
                await r.generate(prompt, params, routing_key="warm")
            for i in range(args.requests):
                for name, c in (("direct", d), ("router", r))[:: 1 if i % 2 else -1]:
                    t = time.perf_counter()
                    await c.generate(prompt, params, routing_key=f"k{i}")
                    lat[name].append(time.perf_counter() - t)
            tput = {
                name: await _throughput(c, prompt, params, args.requests, 32)
                for name, c in (("direct", d), ("router", r))
            }
        out: dict[str, Any] = {}
        for name, xs in lat.items():
            xs.sort()
            out[f"{name}_median_ms"] = 1e3 * statistics.median(xs)
            out[f"{name}_p90_ms"] = 1e3 * xs[int(0.9 * len(xs))]
            out[f"{name}_req_per_s_32_clients"] = tput[name]
        out["added_median_ms"] = out["router_median_ms"] - out["direct_median_ms"]
        out["latency_ratio"] = out["router_median_ms"] / out["direct_median_ms"]
        out["throughput_ratio"] = tput["router"] / tput["direct"]
        return out

    with _fleet_config(args, model, 1, "manual").build() as fleet:
        return asyncio.run(run(fleet.engines[0].url, fleet.url))


async def _throughput(c: Any, prompt: list[int], params: Any, n: int, clients: int) -> float:
    """Requests per second with ``clients`` requests in flight (``n`` in all)."""
    sem = asyncio.Semaphore(clients)

    async def one(i: int) -> None:
        async with sem:
            await c.generate(prompt, params, routing_key=f"t{i % clients}")

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t)


def hit_rate(args: argparse.Namespace, model: str, policy: str) -> dict[str, Any]:
    from miles_rollout import SamplingParams, SGLangClient

    rng = random.Random(0)
    first = [[rng.randrange(3, 500) for _ in range(args.prompt_tokens)] for _ in args_range(args)]
    tools = [
        [[rng.randrange(3, 500) for _ in range(args.tool_tokens)] for _ in range(args.turns)]
        for _ in args_range(args)
    ]

    async def session(c: SGLangClient, s: int) -> tuple[int, int, int]:
        ids, seen, reusable, cached, prompt_total = list(first[s]), 0, 0, 0, 0
        for t in range(args.turns):
            out = await c.generate(
                ids,
                SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=s * 100 + t),
                routing_key=f"session-{s}",
            )
            reusable += seen  # tokens this session sent or got back before
            cached += int(out.cached_tokens or 0)
            prompt_total += len(ids)
            ids = ids + out.output_ids
            seen = len(ids)
            ids = ids + tools[s][t]
        return reusable, cached, prompt_total

    async def run(url: str) -> list[tuple[int, int, int]]:
        async with SGLangClient(url, timeout=600) as c:
            return list(await asyncio.gather(*(session(c, s) for s in args_range(args))))

    with _fleet_config(args, model, 2, policy).build() as fleet:
        start = time.perf_counter()
        per = asyncio.run(run(fleet.url))
        wall = time.perf_counter() - start
        # The engines' own counters, read directly (the fleet polls only every 2 s).
        states = [s for e in fleet.engines for s in _server_info(e.url)["internal_states"]]
    reusable = sum(r for r, _, _ in per)
    cached = sum(c for _, c, _ in per)
    return {
        "policy": policy,
        "reusable_tokens": reusable,
        "cached_tokens": cached,
        "prompt_tokens": sum(p for _, _, p in per),
        "hit_rate": cached / reusable if reusable else 0.0,
        "wall_s": wall,
        "engine_prompt_tokens": [s.get("num_prompt_tokens") for s in states],
        "engine_cached_prompt_tokens": [s.get("num_cached_prompt_tokens") for s in states],
    }


def _server_info(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def args_range(args: argparse.Namespace) -> range:
    return range(args.sessions)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["overhead", "hit-rate"], default=None)
    p.add_argument("--backend", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--model-path", default=None)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tool-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    model = args.model_path or str(build_model(Path(tempfile.mkdtemp()) / "model"))
    results: dict[str, Any] = {}
    if args.only in (None, "overhead"):
        results["overhead"] = o = overhead(args, model)
        print(
            f"router overhead ({args.requests} sequential requests, prompt 8, 1 new token): "
            f"median {o['direct_median_ms']:.2f} ms direct vs {o['router_median_ms']:.2f} ms "
            f"routed (+{o['added_median_ms']:.2f} ms, x{o['latency_ratio']:.2f}); p90 "
            f"{o['direct_p90_ms']:.2f} vs {o['router_p90_ms']:.2f} ms; 32 clients: "
            f"{o['direct_req_per_s_32_clients']:.0f} vs {o['router_req_per_s_32_clients']:.0f} "
            f"req/s (x{o['throughput_ratio']:.2f})",
            flush=True,
        )
    if args.only in (None, "hit-rate"):
        for policy in ("manual", "round_robin"):
            results[f"hit_rate_{policy}"] = h = hit_rate(args, model, policy)
            print(
                f"prefix-cache hits, {args.sessions} sessions x {args.turns} turns, "
                f"policy {policy}: {h['cached_tokens']}/{h['reusable_tokens']} reusable prompt "
                f"tokens cached = {100 * h['hit_rate']:.1f}% ({h['prompt_tokens']} prompt "
                f"tokens in all, {h['wall_s']:.1f} s); engines' own counters: "
                f"{sum(h['engine_cached_prompt_tokens'])} cached of "
                f"{sum(h['engine_prompt_tokens'])} prompt tokens",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
