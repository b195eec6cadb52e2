"""Prefix-cache hit rate of multi-turn sessions under memory pressure, with and without KV
reservation for live sessions.

Why: agentic sessions come back after a tool runs; meanwhile other requests (other sessions'
first turns, evaluation, one-off prompts) fill the prefix cache, and plain LRU evicts exactly
the idle sessions whose next turn is on its way. Reservation (``EngineConfig.
session_reservation``, the policy in ``miles_rollout/_prefix_cache.py``) keeps a session's
history cached between its turns while the pool has room. This script builds a small Qwen3
from a config (random weights, no download) and plays ``--sessions`` sessions of ``--turns``
turns, round robin (every session's turn k, then every session's turn k + 1: sessions wait on
their tools meanwhile), with ``--background`` one-off requests without a session key after each
turn, against three engines with the same checkpoint:

- LRU: ``session_reservation=False``, ``prefix_cache_tokens=--cache-tokens``;
- reservation: the default policy, same capacity;
- unlimited cache (the physical limit): every reusable token hits.

Reported: the session turns' hit rate (cached / prompt tokens) and its share of the reusable
tokens (what the unlimited cache hits).

Laptop:   python tools/bench/prefix_cache_reservation.py        # ~1 min on 2 cores
Cluster:  not meant for GPUs; SGLang's radix cache has no session reservation to compare.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch


def build_model(args: argparse.Namespace, path: str) -> None:
    """Write a random Qwen3 checkpoint to ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def play(args: argparse.Namespace, path: str, **engine: object) -> dict[str, float]:
    """Run the workload on one engine; return session hit counts and the engine's counters."""
    from miles_rollout import EngineConfig, SamplingParams

    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, args.vocab) for _ in range(n)]

    turn = SamplingParams(max_new_tokens=args.output, ignore_eos=True, seed=0)
    one_off = SamplingParams(max_new_tokens=args.output, ignore_eos=True, seed=1)
    system = tokens(args.system)
    cached = prompt = 0
    with EngineConfig(model_path=path, num_threads=1, **engine).build() as eng:  # type: ignore[arg-type]
        histories = [system + tokens(args.first) for _ in range(args.sessions)]
        for _k in range(args.turns):
            for s in range(args.sessions):
                out = eng.generate(histories[s], turn, routing_key=f"session-{s}")
                cached += out.cached_tokens
                prompt += out.prompt_tokens
                histories[s] = histories[s] + out.output_ids + tokens(args.observation)
                for _ in range(args.background):
                    eng.generate(tokens(args.background_tokens), one_off)
        state = eng.server_info()["internal_states"][0]
    return {
        "cached": cached,
        "prompt": prompt,
        "evicted": state["prefix_cache_evicted_tokens"],
        "sessions": state["prefix_cache_sessions"],
        "refused": state["prefix_cache_reservations_refused"],
        "dropped": state["prefix_cache_reservations_dropped"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=128, help="shared system prompt tokens")
    parser.add_argument("--first", type=int, default=160, help="each session's first message")
    parser.add_argument("--output", type=int, default=24, help="generated tokens per turn")
    parser.add_argument("--observation", type=int, default=64, help="tool tokens per turn")
    parser.add_argument("--background", type=int, default=1, help="one-off requests per turn")
    parser.add_argument("--background-tokens", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=8192, help="the pool under pressure")
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(args, tmp)
        runs = {
            "LRU (no reservation)": play(
                args, tmp, prefix_cache_tokens=args.cache_tokens, session_reservation=False
            ),
            "session reservation": play(args, tmp, prefix_cache_tokens=args.cache_tokens),
            "unlimited cache (limit)": play(args, tmp, prefix_cache_tokens=1 << 22),
        }
    final = args.system + args.first + (args.turns - 1) * (args.output + args.observation)
    print(
        f"{args.sessions} sessions x {args.turns} turns (history at the last turn: {final} "
        f"tokens each, {args.sessions * final} in all), {args.background} one-off request(s) "
        f"of {args.background_tokens} tokens after each turn; cache {args.cache_tokens} tokens"
    )
    reusable = runs["unlimited cache (limit)"]["cached"]
    print("policy                  | session hit rate | of reusable | evicted | reserved sessions")
    for name, r in runs.items():
        reserved = f"{r['sessions']:.0f} (refused {r['refused']:.0f}, dropped {r['dropped']:.0f})"
        print(
            f"{name:23s} | {r['cached'] / r['prompt']:16.3f} | {r['cached'] / reusable:11.3f} | "
            f"{r['evicted']:7.0f} | {reserved}"
        )


if __name__ == "__main__":
    main()
