"""The Verifiers side of `miles_env.integrations.verifiers`: run in Verifiers' own Python.

    python -P _verifiers_bridge.py        # -P: this folder must not shadow `verifiers`

It reads one JSON request per line on stdin and writes one JSON reply per line on stdout
(``{"id", "ok", "result"}`` or ``{"id", "ok": false, "error", "type"}``); anything the
framework prints goes to stderr. Requests (``op``):

- ``load``: ``taskset`` (a Verifiers taskset id: an importable module exporting its
  ``Taskset`` subclass), ``config`` (the taskset config's fields): the tasks' ``idx``, ``id``,
  ``name`` and ``messages`` (the prompt as OpenAI messages).
- ``reset`` / ``step`` / ``reward`` / ``close``: one episode driven from outside. ``reset``
  takes ``task`` (an ``idx`` or an ``id``), starts the task's toolsets in process (Verifiers'
  own ``Toolset.register`` into an MCP server, called without a transport) and answers the
  prompt messages and the tools as OpenAI dicts (named as Verifiers' chat program names them:
  ``<server>_<tool>``, bare without a prefix); ``step`` runs ``calls``; ``reward`` scores
  ``messages`` with the task's own ``score`` (its ``@vf.reward`` functions with their weights
  and its judges; those that need a runtime are skipped) and answers each reward by name, the
  weighted total and the metrics.
- ``rollout``: Verifiers' own loop on one task: an ``Agent`` with its chat program (the
  ``null`` harness's), its interception server, the task's toolsets as MCP servers, scoring;
  the model is the OpenAI endpoint ``base_url`` (a TITO session, which answers the chat
  program's streamed requests as OpenAI does). Only the provisioning differs from
  ``vf-eval``: the program runs with this Python instead of a ``uv`` environment (no
  download).

Requests run concurrently (replies carry the request's ``id``); one episode at a time is
driven by ``reset`` / ``step`` / ``reward``, any number of ``rollout`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import traceback
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire, parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
from verifiers.v1.trace import AgentInfo, TraceTask

__all__ = ["LocalChatHarness"]

HARNESS_ID = "miles_verifiers_bridge"


class _NoUv:
    """A runtime whose ``prepare_uv_script`` runs the script with this Python."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(
        self, script: str | bytes, env: Any = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-chat-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    """Verifiers' ``null`` harness (its chat program, MCP tools, resume), run with this
    Python: the program's dependencies (openai, mcp, httpx) are Verifiers' own."""

    async def setup(self, runtime: Any) -> None:
        return None

    async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kw: Any) -> Any:
        return await super().launch(ctx, trace, _NoUv(runtime), *args, **kw)


def _wire(task: Any) -> list[dict[str, Any]]:
    data = task.data
    out: list[dict[str, Any]] = []
    if data.system_prompt:
        out.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        out.extend(message_to_wire(m) for m in data.prompt)
    return out


class Bridge:
    def __init__(self) -> None:
        self.taskset: Any = None
        self.tasks: list[Any] = []
        self.task: Any = None
        self.tools: dict[str, tuple[Any, str]] = {}  # full name -> (mcp server, raw name)
        self.stack = contextlib.AsyncExitStack()

    def _pick(self, ref: Any) -> Any:
        if self.taskset is None:
            raise RuntimeError("no taskset: send load first")
        for t in self.tasks:
            if (isinstance(ref, int) and t.data.idx == ref) or (
                isinstance(ref, str) and ref in (t.data.id, t.data.name)
            ):
                return t
        have = ", ".join(str(t.data.id or t.data.idx) for t in self.tasks[:20])
        raise ValueError(f"taskset {self.taskset.config.id!r} has no task {ref!r}; it has {have}")

    async def load(self, taskset: str, config: dict[str, Any] | None = None) -> Any:
        self.taskset = vf.load_taskset(
            vf.taskset_config_type(taskset).model_validate({**(config or {}), "id": taskset})
        )
        self.tasks = list(self.taskset)
        return [
            {"idx": t.data.idx, "id": t.data.id, "name": t.data.name, "messages": _wire(t)}
            for t in self.tasks
        ]

    async def reset(self, task: Any) -> Any:
        from mcp.server.mcpserver import MCPServer

        await self.close()
        self.task = self._pick(task)
        servers = [
            *type(self.taskset).toolsets(self.taskset.config),
            *type(self.task).toolsets(self.task.config),
        ]
        tools: list[dict[str, Any]] = []
        for server in servers:
            await self.stack.enter_async_context(server._exit_stack)
            await server.setup()
            await server.setup_task(self.task)
            mcp = MCPServer(server.server_name or type(server).__name__)
            server.register(mcp)
            for t in await mcp.list_tools():
                full = f"{server.server_name}_{t.name}" if server.server_name else t.name
                self.tools[full] = (mcp, t.name)
                fn = {
                    "name": full,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                }
                tools.append({"type": "function", "function": fn})
        return {"messages": _wire(self.task), "tools": tools, "task": self._name(self.task)}

    @staticmethod
    def _name(task: Any) -> str:
        return str(task.data.id or task.data.name or f"task-{task.data.idx}")

    async def step(self, calls: list[dict[str, Any]]) -> Any:
        out = []
        for i, call in enumerate(calls):
            fn = call.get("function") or {}
            name, cid = str(fn.get("name", "")), str(call.get("id") or f"call_{i}")
            error = True
            try:
                if name not in self.tools:
                    raise ValueError(
                        f"unknown tool {name!r}; the tools are {', '.join(self.tools)}"
                    )
                args = fn.get("arguments") or "{}"
                args = json.loads(args) if isinstance(args, str) else args
                if not isinstance(args, dict):
                    raise ValueError(f"arguments must be a JSON object, got {args!r}")
                mcp, raw = self.tools[name]
                result = await mcp.call_tool(raw, args)
                content = mcp_content_to_chat_content(result.content)
                error = bool(getattr(result, "is_error", False))
            except Exception as e:
                content = f"error: {e}"
            out.append({"role": "tool", "tool_call_id": cid, "content": content, "error": error})
        return {"messages": out}

    async def reward(self, messages: list[dict[str, Any]]) -> Any:
        if self.task is None:
            raise RuntimeError("reward before reset")
        task = self.task
        trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig()),
        )
        for i, m in enumerate(messages):
            msg = parse_message(dict(m))
            node = MessageNode(
                parent=i - 1 if i else None, message=msg, sampled=m.get("role") == "assistant"
            )
            trace.nodes.append(node)
        await task.score(trace)
        return _scores(trace)

    async def close(self) -> None:
        stack, self.stack = self.stack, contextlib.AsyncExitStack()
        self.tools, self.task = {}, None
        await stack.aclose()

    async def rollout(
        self,
        task: Any,
        base_url: str,
        model: str = "policy",
        max_turns: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Any:
        t = self._pick(task)
        config = vf.AgentConfig(
            harness=vf.HarnessConfig(id=HARNESS_ID),
            runtime=vf.SubprocessConfig(),
            model=model,
            client=vf.EvalClientConfig(base_url=base_url, api_key_var="MILES_VERIFIERS_KEY"),
            sampling=vf.SamplingConfig(**(sampling or {})) if sampling else None,
            max_turns=max_turns,
        )
        trace = await vf.make_agent(config).run(t)
        return {
            **_scores(trace),
            "task": self._name(t),
            "messages": [message_to_wire(m) for m in trace.messages],
            "num_turns": trace.num_turns,
            "stop_condition": trace.stop_condition,
            "errors": [f"{e.type}: {e.message}" for e in trace.errors],
        }


def _scores(trace: Any) -> dict[str, Any]:
    rewards = {k: (None if r is None else r.score) for k, r in trace.rewards.items()}
    weights = {k: r.weight for k, r in trace.rewards.items() if r is not None}
    return {
        "reward": trace.reward,
        "rewards": rewards,
        "weights": weights,
        "metrics": dict(trace.metrics),
    }


async def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the framework prints must not mix with the replies
    sys.stdout = sys.stderr
    os.environ.setdefault("MILES_VERIFIERS_KEY", "miles")
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])  # the harness id resolves here
    bridge = Bridge()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    pending: set[asyncio.Task[None]] = set()

    async def serve(req: dict[str, Any]) -> None:
        rid = req.pop("id", None)
        op = str(req.pop("op", ""))
        try:
            if op not in ("load", "reset", "step", "reward", "close", "rollout"):
                raise ValueError(f"unknown op {op!r}")
            reply = {"id": rid, "ok": True, "result": await getattr(bridge, op)(**req)}
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            reply = {"id": rid, "ok": False, "error": str(e), "type": type(e).__name__}
        out.write(json.dumps(reply, default=str) + "\n")

    while line := await reader.readline():
        t = asyncio.create_task(serve(json.loads(line)))
        pending.add(t)
        t.add_done_callback(pending.discard)
    await asyncio.gather(*pending)
    await bridge.close()


if __name__ == "__main__":
    asyncio.run(main())
