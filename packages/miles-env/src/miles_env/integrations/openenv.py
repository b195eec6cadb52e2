"""An OpenEnv environment server as an `Environment`: reset / step / state over its WebSocket.

OpenEnv (``pip install openenv``) serves an environment over HTTP (``/reset``, ``/step``,
``/state``, ``/schema``); ``/reset`` and ``/step`` each make a fresh environment, so stateful
episodes use the ``/ws`` session (messages ``reset``, ``step``, ``state``, ``close``), which is
what this adapter speaks. The environment's action (its JSON schema from ``/schema``) becomes
one tool the agent calls; each call is one ``step`` and its observation the tool message; the
episode's reward is the sum of the step rewards (``final``: the last one), and the episode ends
when the server says ``done``.

    env = OpenEnvEnv("http://127.0.0.1:8000", tool_name="guess")
    result = await run_episode(env, {"prompt": "Guess the number", "reset": {"seed": 1}}, chat)

HTTP and WebSocket through aiohttp (``pip install 'miles-env[rollout]'``); the server may run
in OpenEnv's own Python.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from miles_env.environment.chat import _aiohttp
from miles_env.environment.protocol import (
    Observation,
    StepResult,
    ToolArgumentsError,
    function_tool,
    parse_arguments,
)
from miles_env.environment.tools import clip

__all__ = ["OpenEnvEnv"]

# Fields every OpenEnv action model inherits; not the agent's business.
_BASE_ACTION_FIELDS = ("metadata",)


class OpenEnvEnv:
    """An OpenEnv server at ``url`` as an `Environment` (module docstring).

    Args:
        url: the server's base URL (``http://host:port``).
        tool_name: the name of the one tool (the environment's action).
        tool_description: its description (default: the action schema's).
        timeout_s: the most seconds one message may take.
        max_output_chars: observations are clipped to about this many characters.

    ``reset`` takes a dict: ``prompt`` (the user message; the reset observation is appended)
    or ``messages``, and ``reset`` (keyword arguments of the server's reset: ``seed``,
    ``episode_id``, ...). ``info``: ``task``, ``tool_calls``, ``tool_errors``, ``tool_s``,
    ``done``, ``state`` (the server's state at the end).
    """

    def __init__(
        self,
        url: str,
        *,
        tool_name: str = "step",
        tool_description: str | None = None,
        timeout_s: float = 120.0,
        max_output_chars: int = 4000,
    ) -> None:
        self.url = url.rstrip("/")
        self.tool_name = tool_name
        self.tool_description = tool_description
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.info: dict[str, Any] = {}
        self._aiohttp = _aiohttp()
        self._http: Any = None
        self._ws: Any = None
        self._tool: dict[str, Any] = {}
        self._rewards: list[float] = []
        self._done = False

    async def _send(self, message: Mapping[str, Any]) -> dict[str, Any]:
        await self._ws.send_json(dict(message))
        reply = await self._ws.receive_json(timeout=self.timeout_s)
        if reply.get("type") == "error":
            raise RuntimeError(f"OpenEnv {message.get('type')}: {reply.get('data')}")
        return dict(reply.get("data") or {})

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        """Open a ``/ws`` session, read the action schema, reset the environment."""
        await self.close()
        aiohttp = self._aiohttp
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._http.get(f"{self.url}/schema") as resp:
            if resp.status != 200:
                raise RuntimeError(f"OpenEnv /schema: HTTP {resp.status}: {await resp.text()}")
            schema = (await resp.json())["action"]
        props = {
            k: v for k, v in schema.get("properties", {}).items() if k not in _BASE_ACTION_FIELDS
        }
        required = [k for k in schema.get("required", []) if k in props]
        self._tool = function_tool(
            self.tool_name,
            self.tool_description or schema.get("description") or "Act in the environment.",
            props,
            required,
        )
        ws_url = "ws" + self.url[len("http") :] + "/ws"
        self._ws = await self._http.ws_connect(ws_url, heartbeat=30)
        self._rewards, self._done = [], False
        self.info = {
            "task": str(task.get("name", "openenv")),
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_s": 0.0,
            "done": False,
            "state": None,
            "reward_reason": "",
            "verifier_error": None,
        }
        first = await self._send({"type": "reset", "data": dict(task.get("reset") or {})})
        seen = json.dumps(first.get("observation", {}))
        if task.get("messages"):
            messages = [dict(m) for m in task["messages"]]
        else:
            prompt = str(task.get("prompt") or "Act in the environment with the tool.")
            messages = [{"role": "user", "content": f"{prompt}\n\nObservation: {seen}"}]
        return Observation(messages=messages, tools=[self._tool])

    async def step(self, tool_calls: list[dict[str, Any]]) -> StepResult:
        """One ``step`` per call, in order, until the server says done."""
        out = []
        for i, call in enumerate(tool_calls):
            cid = str(call.get("id") or f"call_{i}")
            t0 = time.monotonic()
            try:
                if self._done:
                    raise ToolArgumentsError("the episode is over")
                name = str((call.get("function") or {}).get("name", ""))
                if name != self.tool_name:
                    raise ToolArgumentsError(f"unknown tool {name!r}; the tool is {self.tool_name}")
                data = await self._send({"type": "step", "data": parse_arguments(call, self._tool)})
                reward = data.get("reward")
                if reward is not None:
                    self._rewards.append(float(reward))
                self._done = bool(data.get("done"))
                content = clip(json.dumps(data.get("observation", {})), self.max_output_chars)
                if self._done:
                    content += "\n(episode done)"
            except (ToolArgumentsError, RuntimeError) as e:
                content = f"error: {e}"
                self.info["tool_errors"] += 1
            self.info["tool_s"] += time.monotonic() - t0
            self.info["tool_calls"] += 1
            out.append({"role": "tool", "tool_call_id": cid, "content": content})
        self.info["done"] = self._done
        return StepResult(messages=out, done=self._done)

    async def reward(self, messages: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """``{"reward": sum of step rewards, "final": the last one}``; records the state."""
        try:
            self.info["state"] = await self._send({"type": "state"})
        except RuntimeError as e:
            self.info["notes"] = [f"state: {e}"]
        total = sum(self._rewards)
        self.info["reward_reason"] = f"{len(self._rewards)} step rewards, done={self._done}"
        return {"reward": total, "final": self._rewards[-1] if self._rewards else 0.0}

    async def close(self) -> None:
        """Send ``close`` and drop the WebSocket session. Idempotent."""
        ws, self._ws = self._ws, None
        http, self._http = self._http, None
        if ws is not None and not ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_json({"type": "close"})
            await ws.close()
        if http is not None:
            await http.close()
