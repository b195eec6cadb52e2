"""Where an agentic rollout step's time goes: sandboxes (setup, tool commands, verifier,
teardown) against generation (the policy's chat turns through the TITO session server).

Why: an agentic step mixes two costs that scale differently: generation with model size and
tokens per turn, sandboxes with the number of commands and verifier runs. Their ratio says
where to spend effort (more engines, or cheaper sandboxes / more rollout workers). Measured on
one rollout step of the built-in terminal tasks, every episode in its own local sandbox, all
episodes of the step at once:

- ``model``: SmolLM2-135M-Instruct (bf16, the embedded engine in this process) acts through a
  TITO session server (``miles_env.rollout:terminal_agent`` via ``MultiTurnGenerate``);
- ``scripted``: the same tasks with the scripted tool-calling policy (no model compute: its
  share is the sandbox floor of the same path, the named peer).

Per run: summed seconds in generation and in sandboxes over the episodes, the sandbox share
of the two, the step's wall time, tool calls, generated tokens.

Laptop (root, bubblewrap; a few minutes): python tools/bench/agentic_step_share.py
Cluster (GPU): the same with --engine-url http://sglang:30000 --model-path /models/Qwen3-8B.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from miles.agentic.scripted import ScriptedPolicy
from miles.agentic.task import HarborTaskSet
from miles_env.rollout import terminal_agent
from miles_rollout import (
    EngineConfig,
    GenerateContext,
    LocalEngineClient,
    MultiTurnGenerate,
    Sample,
    SamplingParams,
    SGLangClient,
)
from miles_rollout.session import start_sessions


async def _step(
    client: Any, tok: Any, gen: Any, items: list[Any], n: int, params: Any
) -> dict[str, Any]:
    sessions = (
        await start_sessions(client, tokenizer=tok)
        if getattr(gen, "needs_sessions", False)
        else None
    )
    ctx = GenerateContext(
        client=client,
        tokenizer=tok,
        sampling_params=params,
        sessions_url=sessions.url if sessions else None,
    )
    samples = [
        Sample(
            group_index=g, index=i, prompt=it.messages, label=it.label, metadata=dict(it.metadata)
        )
        for g, it in enumerate(items)
        for i in range(n)
    ]
    t0 = time.perf_counter()
    try:
        done = await asyncio.gather(*(gen(ctx, s) for s in samples))
    finally:
        if sessions is not None:
            await sessions.close()
    wall = time.perf_counter() - t0
    eps = [s.metadata.get("metrics", {}) for s in done]
    failed = [s.metadata.get("error") for s in done if s.metadata.get("error")]

    def total(k: str) -> float:
        return sum(float(e.get(f"agentic/{k}", 0.0)) for e in eps)

    gen_s, box_s = total("generate_s"), total("sandbox_s")
    return {
        "episodes": len(done),
        "failed": failed,
        "wall_s": wall,
        "generate_s": gen_s,
        "sandbox_s": box_s,
        "sandbox_share": box_s / (gen_s + box_s) if gen_s + box_s else 0.0,
        "turns": total("turns"),
        "tool_calls": total("tool_calls"),
        "response_tokens": sum(s.response_length for s in done),
        "reward_mean": sum(float(s.metadata.get("reward", 0.0)) for s in done) / len(done),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from miles_rollout.models import smollm2_dir

    model = args.model_path or str(smollm2_dir())
    tasks = HarborTaskSet(toolset="bash", max_turns=args.max_turns, seed=0)
    items = tasks.sample(args.prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens, seed=None)
    out: dict[str, Any] = {"model": model, "prompts": args.prompts, "n": args.n}
    if args.engine_url:
        client: Any = SGLangClient(args.engine_url)
        engine = None
    else:
        engine = EngineConfig(
            model_path=model, dtype="bfloat16", seed=0, context_length=4096
        ).build()
        client = LocalEngineClient(engine)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    try:
        async with client:
            for name, gen in (
                ("scripted", ScriptedPolicy()),
                ("model", MultiTurnGenerate(terminal_agent)),
            ):
                out[name] = await _step(client, tok, gen, items, args.n, params)
                print(name, json.dumps(out[name]), flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=2, help="tasks in the step")
    p.add_argument("--n", type=int, default=4, help="episodes per task")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per turn")
    p.add_argument("--model-path", help="default: SmolLM2-135M-Instruct (converted once)")
    p.add_argument("--engine-url", help="an SGLang-API server instead of the embedded engine")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
