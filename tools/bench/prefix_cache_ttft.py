"""Time to first token of turn k of a multi-turn session, with and without the prefix cache.

Why: an agentic session re-sends its whole history every turn; without a prefix cache each
turn re-prefills all of it, so time to first token (TTFT) grows with the turn number. With the
cache only the new tokens (the last output's tail, the tool observation, the user message) are
prefilled. This script builds a ~10M-parameter Qwen3 from a config (random weights, no
download) and plays ``--sessions`` sessions of ``--turns`` turns against two engines built
from the same checkpoint: one with the prefix cache, one without (the baseline). Every turn
starts with a shared system prompt, then each earlier turn's output (``--output`` tokens) and
tool observation (``--observation`` tokens), then a user message (``--user`` tokens).

TTFT is measured as the latency of the turn's prompt with ``max_new_tokens=1`` (the engine
does not stream; one sampled token is exactly prefill plus the first sample), one request at a
time. The physical floor is the same measurement for a prompt made of only the turn's uncached
tokens (no history to attend to). The full turn is then generated on the cached engine (its
output feeds the next turn).

Laptop:   python tools/bench/prefix_cache_ttft.py                 # ~2 min on 2 cores
          python tools/bench/prefix_cache_ttft.py --dtype bfloat16 --sessions 3
Cluster:  not meant for GPUs (the embedded engine is CPU-only); SGLang has its own radix cache.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch


def build_model(args: argparse.Namespace, path: str) -> int:
    """Write a random Qwen3 checkpoint to ``path``; return its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=384, help="shared system prompt tokens")
    parser.add_argument("--output", type=int, default=48, help="generated tokens per turn")
    parser.add_argument("--observation", type=int, default=96, help="tool tokens per turn")
    parser.add_argument("--user", type=int, default=32, help="user tokens per turn")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1152)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from miles_rollout import EngineConfig, SamplingParams

    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, args.vocab) for _ in range(n)]

    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    turn_params = SamplingParams(max_new_tokens=args.output, ignore_eos=True, temperature=1.0)

    def ttft(engine: object, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        out = engine.generate(prompt, one)  # type: ignore[attr-defined]
        return time.perf_counter() - start, out.cached_tokens

    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(args, tmp)
        common = {"model_path": tmp, "dtype": args.dtype, "num_threads": args.threads}
        cached = EngineConfig(**common).build()
        plain = EngineConfig(**common, enable_prefix_cache=False).build()
        try:
            for eng in (cached, plain):  # warm up (allocations, the invariance check)
                eng.generate(tokens(64), one)
            cached.flush_cache()
            system = tokens(args.system)
            with_cache: dict[int, list[float]] = {}
            without: dict[int, list[float]] = {}
            floor: dict[int, list[float]] = {}
            lengths: dict[int, int] = {}
            hits: dict[int, list[int]] = {}
            for _ in range(args.sessions):
                history = list(system)
                for k in range(1, args.turns + 1):
                    new = tokens(args.user)
                    prompt = history + new
                    lengths[k] = len(prompt)
                    t_cached, hit = ttft(cached, prompt)
                    t_plain, _ = ttft(plain, prompt)
                    t_floor, _ = ttft(plain, prompt[hit:])
                    with_cache.setdefault(k, []).append(t_cached)
                    without.setdefault(k, []).append(t_plain)
                    floor.setdefault(k, []).append(t_floor)
                    hits.setdefault(k, []).append(hit)
                    out = cached.generate(prompt, turn_params)
                    history = prompt + out.output_ids + tokens(args.observation)
            state = cached.server_info()["internal_states"][0]
        finally:
            cached.shutdown()
            plain.shutdown()

    print(
        f"Qwen3 {n_params / 1e6:.1f}M params, {args.dtype}, {args.threads} thread(s); "
        f"{args.sessions} sessions x {args.turns} turns: system {args.system}, per turn "
        f"user {args.user} + output {args.output} + observation {args.observation} tokens"
    )
    print("TTFT medians over sessions (ms); floor = prefill of only the uncached tokens")
    print("turn | prompt | cached | no cache | with cache | floor | speed-up | cache/floor")
    for k in sorted(with_cache):
        c, p, f = (statistics.median(d[k]) * 1e3 for d in (with_cache, without, floor))
        median_hit = statistics.median(hits[k])
        print(
            f"{k:4d} | {lengths[k]:6d} | {median_hit:6.0f} | {p:8.1f} | {c:10.1f} | {f:5.1f} | "
            f"{p / c:7.2f}x | {c / f:10.2f}x"
        )
    print(
        f"cache hit rate over all requests: {state['cache_hit_rate']:.3f} "
        f"({state['num_cached_prompt_tokens']} of {state['num_prompt_tokens']} prompt tokens)"
    )


if __name__ == "__main__":
    main()
