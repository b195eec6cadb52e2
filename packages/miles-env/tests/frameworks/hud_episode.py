"""HUD templates driven by miles-env's episode loop, run in HUD's own Python: prints one JSON
line per episode (``reward``, ``stopped``, ``reason``, ``messages``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import hud

from miles_env.environment import run_episode
from miles_env.integrations.hud import HudTemplateEnv

env = hud.Environment("arith")


@env.template(id="add", description="Add two integers.")
async def add(a: int, b: int) -> Any:
    answer = yield f"What is {a} + {b}? Answer with the number."
    yield 1.0 if str(a + b) in str(answer) else 0.0


@env.template(id="broken")
async def broken() -> Any:
    yield "Say anything."
    yield "not a score"


def agent(answer: str) -> Any:
    async def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        if len(messages) == 1:  # first try a tool: this task has none
            call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        return {"role": "assistant", "content": answer}

    return chat


async def main() -> None:
    for task, answer in (
        (add(a=20, b=22), "It is 42."),
        (add(a=20, b=22), "It is 41."),
        ({"template": "broken"}, "x"),
    ):
        r = await run_episode(HudTemplateEnv(env), task, agent(answer))
        out = {
            "reward": r.reward,
            "stopped": r.stopped,
            "reason": r.info["reward_reason"],
            "messages": r.messages,
        }
        print(json.dumps(out), flush=True)
    try:
        await run_episode(HudTemplateEnv(env), {"template": "nope"}, agent("x"))
    except ValueError as e:
        print(json.dumps({"error": str(e)}), flush=True)


asyncio.run(main())
