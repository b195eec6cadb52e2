"""A NeMo Gym resources server as an `Environment`: its tools and its ``/verify`` reward.

NeMo Gym (``pip install nemo-gym``, Python 3.12) splits an environment into a resources server
(tools as ``POST /<tool>`` endpoints, ``POST /seed_session``, ``POST /verify``), an agent
server and a model server. Here Miles' episode driver plays the agent and the TITO session is
the model: a task row (``{"responses_create_params": {"input": [...], "tools": [...]}, ...}``,
NeMo Gym's JSONL format) becomes the opening chat messages and tools, each tool call is a
``POST`` to the resources server (one cookie session per episode, as NeMo Gym's own agent
keeps), and the reward is what ``/verify`` says about the whole trajectory, sent in the
Responses API shape NeMo Gym validates (``function_call`` / ``function_call_output`` /
``message`` output items).

    env = NemoGymEnv("http://127.0.0.1:8001")
    result = await run_episode(env, row, chat)

Speaks HTTP only (aiohttp: ``pip install 'miles-env[rollout]'``): the resources server may run
in NeMo Gym's own Python.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from miles_env.environment.chat import _aiohttp
from miles_env.environment.protocol import (
    Observation,
    StepResult,
    ToolArgumentsError,
    parse_arguments,
)
from miles_env.environment.tools import clip

__all__ = ["NemoGymEnv", "chat_messages", "chat_tools", "responses_output"]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # input_text / output_text parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses API ``input`` (a string or items with a role) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for item in items:
        role = item.get("role")
        if role == "developer":
            role = "system"
        if role in ("system", "user", "assistant"):
            out.append({"role": role, "content": _text(item.get("content"))})
    return out


def chat_tools(tools: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Responses API function tools as chat-completions tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for t in tools
        if t.get("type", "function") == "function"
    ]


def responses_output(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agent's part of a chat conversation as Responses API output items."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant":
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                out.append(
                    {
                        "type": "function_call",
                        "id": f"fc_{uuid.uuid4().hex[:12]}",
                        "call_id": str(c.get("id")),
                        "name": str(fn.get("name")),
                        "arguments": str(fn.get("arguments") or "{}"),
                        "status": "completed",
                    }
                )
            if m.get("content"):
                out.append(
                    {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex[:12]}",
                        "role": "assistant",
                        "status": "completed",
                        "content": [
                            {"type": "output_text", "text": str(m["content"]), "annotations": []}
                        ],
                    }
                )
        elif m.get("role") == "tool":
            out.append(
                {
                    "type": "function_call_output",
                    "call_id": str(m.get("tool_call_id")),
                    "output": str(m.get("content")),
                }
            )
    return out


class NemoGymEnv:
    """A NeMo Gym resources server at ``url`` as an `Environment` (module docstring).

    Args:
        url: the resources server's base URL.
        timeout_s: the most seconds one HTTP call may take.
        max_output_chars: tool outputs are clipped to about this many characters.

    ``reset`` takes a task row with ``responses_create_params``; ``info`` holds ``task``
    (the row's ``id`` or ``task`` field), ``tool_calls``, ``tool_errors``, ``tool_s``,
    ``verify_s`` and ``reward_reason``.
    """

    def __init__(self, url: str, *, timeout_s: float = 120.0, max_output_chars: int = 4000) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.info: dict[str, Any] = {}
        self._aiohttp = _aiohttp()
        self._http: Any = None
        self._row: dict[str, Any] = {}
        self._tools: list[dict[str, Any]] = []

    async def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        async with self._http.post(f"{self.url}/{path}", json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"NeMo Gym {path}: HTTP {resp.status}: {text[:300]}")
            return json.loads(text) if text else None

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        """Start an episode of the task row (seeds the server's session)."""
        await self.close()
        params = task.get("responses_create_params")
        if not isinstance(params, Mapping) or "input" not in params:
            raise ValueError(
                "a NeMo Gym task row needs responses_create_params with an input (NeMo Gym's "
                f"JSONL format); got keys {sorted(task)}"
            )
        self._row = dict(task)
        self._tools = chat_tools(list(params.get("tools") or []))
        aiohttp = self._aiohttp
        # The server keys its per-episode session by cookie; 127.0.0.1 needs an unsafe jar.
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            cookie_jar=aiohttp.CookieJar(unsafe=True),
        )
        self.info = {
            "task": str(task.get("id", task.get("task", "nemo_gym"))),
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_s": 0.0,
            "verify_s": 0.0,
            "reward_reason": "",
            "verifier_error": None,
        }
        await self._post("seed_session", {})
        return Observation(messages=chat_messages(params["input"]), tools=self._tools)

    async def step(self, tool_calls: list[dict[str, Any]]) -> StepResult:
        """Each call is ``POST /<tool>`` with its arguments; the reply is the tool message."""
        by_name = {t["function"]["name"]: t for t in self._tools}
        out = []
        for i, call in enumerate(tool_calls):
            name = str((call.get("function") or {}).get("name", ""))
            t0 = time.monotonic()
            try:
                if name not in by_name:
                    raise ToolArgumentsError(
                        f"unknown tool {name!r}; the tools are {', '.join(by_name)}"
                    )
                args = parse_arguments(call, by_name[name])
                result = await self._post(name, args)
                content = clip(
                    result if isinstance(result, str) else json.dumps(result), self.max_output_chars
                )
            except (ToolArgumentsError, RuntimeError) as e:
                content = f"error: {e}"
                self.info["tool_errors"] += 1
            self.info["tool_s"] += time.monotonic() - t0
            self.info["tool_calls"] += 1
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(call.get("id") or f"call_{i}"),
                    "content": content,
                }
            )
        return StepResult(messages=out)

    async def reward(self, messages: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """``POST /verify`` with the row's params and the trajectory as a Responses object."""
        t0 = time.monotonic()
        response = {
            "id": f"resp_{uuid.uuid4().hex[:12]}",
            "created_at": int(time.time()),
            "model": "miles",
            "object": "response",
            "output": responses_output(list(messages or [])),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": list(self._row["responses_create_params"].get("tools") or []),
        }
        body = {**self._row, "response": response}
        try:
            verdict = await self._post("verify", body)
            reward = float(verdict["reward"])
            self.info["reward_reason"] = f"reward {reward:g} from /verify"
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            reward = 0.0
            self.info["verifier_error"] = f"/verify failed: {e}"
            self.info["reward_reason"] = self.info["verifier_error"]
        self.info["verify_s"] = time.monotonic() - t0
        return {"reward": reward}

    async def close(self) -> None:
        """Close the HTTP session (and with it the server-side cookie session). Idempotent."""
        http, self._http = self._http, None
        if http is not None:
            await http.close()
