"""The HUD side of `miles_env.integrations.hud`'s `HudAgent`: run in HUD's own Python.

    python -P _hud_bridge.py        # -P: this folder must not shadow the `hud` package

It reads one JSON request per line on stdin and writes one JSON reply per line on stdout
(``{"id", "ok", "result"}`` or ``{"id", "ok": false, "error", "type"}``); anything HUD
prints goes to stderr. Requests (``op``):

- ``templates``: ``source`` (a HUD environment: a ``.py`` file, a folder of them, or a
  module), ``env`` (its name, or None when the source declares one): the environment's
  ``name`` and its ``templates`` (ids).
- ``tasks``: the task rows (HUD's ``Taskset.from_file``) of ``taskset`` (a ``.py`` file or
  folder declaring ``hud.eval.Task`` rows, or a JSON / JSONL file of rows; None: ``source``
  itself) and the environment ``source`` serves: ``name``, ``templates`` (id ->
  description) and ``rows`` (each ``slug``, ``env``, ``id`` (the template), ``args``).
- ``rollout``: HUD's own episode driver (``hud.eval.run.rollout``) on the template
  ``template`` with ``args``: the environment served on loopback by ``LocalRuntime`` (in this
  process) or ``SubprocessRuntime`` (a child per episode, ``runtime: "subprocess"``), HUD's
  ``OpenAIChatAgent`` as the agent with the OpenAI endpoint ``base_url`` as its provider
  (``model``, ``max_steps``, ``completion_kwargs``, ``system_prompt``), then HUD's grade.
  Answers ``reward``, ``grade`` (HUD's grade frame), ``answer``, ``status``,
  ``stop_reason``, ``turns``, ``tool_calls`` and ``errors`` (the trace's error steps).

Requests run concurrently (replies carry the request's ``id``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

# asyncssh (a HUD dependency) trips cryptography's DSA deprecation warnings on import: noise
# in every run's log, not ours to fix.
warnings.filterwarnings("ignore", message="DSA is deprecated")
from hud.agents.openai_compatible.agent import OpenAIChatAgent  # noqa: E402
from hud.agents.types import AgentStep, OpenAIChatConfig  # noqa: E402
from hud.environment import load_environment  # noqa: E402
from hud.eval import LocalRuntime, SubprocessRuntime, Task  # noqa: E402
from hud.eval.run import rollout  # noqa: E402
from hud.eval.taskset import Taskset  # noqa: E402

_envs: dict[tuple[str, str | None], Any] = {}
_OUT = sys.stdout
sys.stdout = sys.stderr  # what HUD or a template prints must not corrupt the replies


def _env(source: str, name: str | None) -> Any:
    key = (source, name)
    if key not in _envs:
        _envs[key] = load_environment(source, name=name)
    return _envs[key]


def templates(source: str, env: str | None = None) -> dict[str, Any]:
    e = _env(source, env)
    return {"name": e.name, "templates": sorted(e.tasks)}


def tasks(source: str, env: str | None = None, taskset: str | None = None) -> dict[str, Any]:
    e = _env(source, env)
    path = Path(taskset or source)
    if not path.exists():
        raise ValueError(
            f"{source!r} is a module, not a file: name the task rows in a taskset file "
            "(a .py file declaring hud.eval.Task rows, or a JSON / JSONL file of rows)"
        )
    rows = [
        t.model_dump(mode="json", include={"slug", "env", "id", "args"})
        for t in Taskset.from_file(path)
    ]
    return {
        "name": e.name,
        "templates": {tid: f.description for tid, f in sorted(e.tasks.items())},
        "rows": rows,
    }


async def run_rollout(
    *,
    source: str,
    env: str | None,
    template: str,
    args: dict[str, Any],
    base_url: str,
    model: str,
    max_steps: int,
    completion_kwargs: dict[str, Any],
    system_prompt: str | None = None,
    runtime: str = "local",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    e = _env(source, env)
    if template not in e.tasks:
        raise ValueError(
            f"HUD environment {e.name!r} has no template {template!r}; it has "
            f"{', '.join(sorted(e.tasks)) or 'none'}"
        )
    if runtime not in ("local", "subprocess"):
        raise ValueError(f"runtime must be 'local' or 'subprocess', got {runtime!r}")
    placement = (LocalRuntime if runtime == "local" else SubprocessRuntime)(source, env=e.name)
    agent = OpenAIChatAgent(
        OpenAIChatConfig(
            base_url=base_url,
            api_key="miles",  # the session endpoint takes no key; the SDK wants one
            model=model,
            max_steps=max_steps,
            completion_kwargs=completion_kwargs,
            system_prompt=system_prompt,
        )
    )
    task = Task(env=e.name, id=template, args=args)
    run = await rollout(task, agent, runtime=placement, rollout_timeout=timeout_s)
    steps = run.trace.steps
    agent_steps = [s for s in steps if isinstance(s, AgentStep)]
    return {
        "reward": run.reward,
        "grade": run.grade.raw,
        "graded": not run.grade.is_error,
        "answer": run.trace.content,
        "status": run.trace.status,
        "stop_reason": run.trace.stop_reason,
        "turns": len(agent_steps),
        "tool_calls": sum(len(s.tool_calls) for s in agent_steps),
        "errors": [s.error for s in steps if s.error],
    }


async def _handle(req: dict[str, Any], out: asyncio.Lock) -> None:
    rid = req.get("id")
    try:
        fields = {k: v for k, v in req.items() if k not in ("id", "op")}
        if req["op"] == "templates":
            result: Any = templates(**fields)
        elif req["op"] == "tasks":
            result = tasks(**fields)
        elif req["op"] == "rollout":
            result = await run_rollout(**fields)
        else:
            raise ValueError(f"unknown op {req['op']!r}")
        reply = {"id": rid, "ok": True, "result": result}
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        reply = {"id": rid, "ok": False, "error": str(exc), "type": type(exc).__name__}
    async with out:
        _OUT.write(json.dumps(reply, default=str) + "\n")
        _OUT.flush()


def _quiet_cancelled(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # HUD's LocalRuntime cancels its control-channel session when an episode ends, and asyncio's
    # stream callback then logs the CancelledError with a traceback: one per episode, no fault.
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


async def main() -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_quiet_cancelled)
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = asyncio.Lock()
    pending: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        if line.strip():
            t = asyncio.create_task(_handle(json.loads(line), out))
            pending.add(t)
            t.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)


if __name__ == "__main__":
    asyncio.run(main())
