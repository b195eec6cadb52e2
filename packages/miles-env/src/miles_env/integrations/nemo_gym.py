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

`NemoGymAgent` is the other way round: NeMo Gym's own agent loop (its ``simple_agent``, run
as NeMo Gym's rollout collection runs it: ``POST /run`` -> ``/seed_session``, the agent's
Responses loop with tools as ``POST /<tool>``, ``/verify``) with NeMo Gym's ``openai_model``
model server pointed at an OpenAI endpoint, as it would be at any provider: give it a TITO
session (``.../sessions/{id}/v1``; the model server calls its ``/responses``) and the
session's samples (token ids, loss mask) are the training data, ``/verify``'s reward the
reward. NeMo Gym needs Python 3.12 and pins its own openai / pydantic, so the loop runs in
NeMo Gym's Python (``tools/setup_agent_frameworks.sh nemo-gym``) behind a bridge process
(``_nemo_gym_bridge.py``, JSON lines over stdio). ``nemo_gym_agent`` is an ``AgentFn`` for
``rollout.agent``::

    rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.nemo_gym:nemo_gym_agent"}
    # each sample: metadata["nemo_gym"] = {"row": {...a task row...},
    #   "resources_server": "resources_servers.my_env.app:MyServer"}   # or "resources_url"
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_env.environment.chat import _aiohttp
from miles_env.environment.protocol import (
    Observation,
    StepResult,
    ToolArgumentsError,
    parse_arguments,
)
from miles_env.environment.tools import clip
from miles_env.integrations._bridge import JsonLinesBridge

__all__ = [
    "NemoGymAgent",
    "NemoGymBridge",
    "NemoGymEnv",
    "NemoGymError",
    "chat_messages",
    "chat_tools",
    "nemo_gym_agent",
    "nemo_gym_python",
    "responses_output",
]


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


_BRIDGE = Path(__file__).with_name("_nemo_gym_bridge.py")


def nemo_gym_python(python: str | os.PathLike[str] | None = None) -> Path:
    """NeMo Gym's own Python: ``python``, else ``$MILES_ENV_PYTHON_NEMO_GYM``, else the one
    ``tools/setup_agent_frameworks.sh nemo-gym`` installs.

    Raises:
        FileNotFoundError: that Python does not exist (the message names the fix).
    """
    if python is None:
        python = os.environ.get("MILES_ENV_PYTHON_NEMO_GYM")
    if python is None:
        cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
        python = cache / "frameworks" / "nemo-gym" / "bin" / "python"
    path = Path(python)
    if not path.exists():
        raise FileNotFoundError(
            f"NeMo Gym's Python {path} does not exist: run tools/setup_agent_frameworks.sh "
            "nemo-gym (or set MILES_ENV_PYTHON_NEMO_GYM)"
        )
    return path


class NemoGymError(RuntimeError):
    """The bridge answered a request with an error (the message is NeMo Gym's)."""


class NemoGymBridge(JsonLinesBridge):
    """The bridge process in NeMo Gym's Python (`_nemo_gym_bridge.py`); episodes run
    concurrently, resources servers it serves live as long as it does.

    Args:
        python: NeMo Gym's Python (`nemo_gym_python`).
    """

    def __init__(self, python: str | os.PathLike[str] | None = None) -> None:
        super().__init__(nemo_gym_python(python), _BRIDGE, NemoGymError, "NeMo Gym")

    async def start(self) -> None:
        """Start the process (once; it imports NeMo Gym, a few seconds, while the caller goes
        on)."""
        await self._spawn()

    async def request(self, op: str, **fields: Any) -> Any:
        """Send one request (starting the process); its result, or `NemoGymError`."""
        await self._spawn()
        return await self._send(op, **fields)

    async def serve_resources(self, server: str, config: Mapping[str, Any] | None = None) -> str:
        """Serve a NeMo Gym resources server in the bridge (once per server and config, for
        the bridge's life); its base URL, e.g. for `NemoGymEnv`.

        Args:
            server: a ``SimpleResourcesServer`` subclass: ``"file.py:Class"`` or
                ``"module:Class"`` (NeMo Gym's shipped ones: ``"resources_servers.<name>.app:
                <Class>"``).
            config: its config fields beyond name / host / port.
        """
        where, sep, attr = server.rpartition(":")
        if where.endswith(".py") and Path(where).exists():  # the bridge runs elsewhere
            server = f"{Path(where).resolve()}{sep}{attr}"
        out = await self.request("serve_resources", server=server, config=dict(config or {}))
        return str(out["url"])


def _outcome(output: list[Mapping[str, Any]], status: str | None, max_steps: int | None) -> str:
    """How the agent's loop ended: ``done`` (a final message), ``length`` (a reply cut by
    ``max_output_tokens``), ``max_turns`` (still calling tools at ``max_steps``)."""
    if status == "incomplete":
        return "length"
    last = output[-1] if output else {}
    if last.get("type") == "message" and last.get("role", "assistant") == "assistant":
        return "done"
    return "max_turns" if max_steps else "done"


def _turns(output: list[Mapping[str, Any]]) -> int:
    """Model calls in the agent's output: each call's items, then its tools' outputs."""
    turns, in_turn = 0, False
    for item in output:
        model_item = item.get("type") != "function_call_output"
        turns += int(model_item and not in_turn)
        in_turn = model_item
    return turns


class NemoGymAgent:
    """An ``AgentFn`` (``async agent(base_url, sample, request) -> metadata``): NeMo Gym's
    ``simple_agent`` plays one task row through the session ``base_url``; the resources
    server's ``/verify`` gives the reward.

    Args:
        resources_server: a NeMo Gym resources server (``SimpleResourcesServer`` subclass)
            to serve in the bridge: ``"file.py:Class"`` or ``"module:Class"`` (NeMo Gym's
            shipped ones: ``"resources_servers.<name>.app:<Class>"``); or
        resources_url: a running resources server's base URL.
        resources_config: the resources server's config fields (with ``resources_server``).
        python: NeMo Gym's Python (`nemo_gym_python`); one bridge process per Python.
        max_turns: the agent's ``max_steps`` (model calls; ``metadata["max_turns"]`` wins).
        model: the model name NeMo Gym's model server sends.
        bridge: a running `NemoGymBridge` to use for its Python (shared, e.g. with a
            `NemoGymEnv` on a resources server it serves; `aclose` ends it too).

    ``metadata["nemo_gym"]`` holds the ``row`` (NeMo Gym's JSONL task row:
    ``responses_create_params`` and the fields ``/verify`` reads) and may set any argument
    above. The rollout's sampling goes into the row's ``responses_create_params``
    (``temperature``, ``top_p``, ``max_tokens`` as ``max_output_tokens``) and, for the
    session's extensions (``top_k``, ``min_p``, ``stop``, ``seed``), the model server's
    ``extra_body``.
    """

    def __init__(
        self,
        resources_server: str | None = None,
        *,
        resources_url: str | None = None,
        resources_config: Mapping[str, Any] | None = None,
        python: str | os.PathLike[str] | None = None,
        max_turns: int = 16,
        model: str = "policy",
        bridge: NemoGymBridge | None = None,
    ) -> None:
        if resources_server and resources_url:
            raise ValueError("NemoGymAgent: pass resources_server or resources_url, not both")
        self.default: dict[str, Any] = {
            "resources_server": resources_server,
            "resources_url": resources_url,
            "resources_config": dict(resources_config or {}),
            "model": model,
        }
        self.python = python
        self.max_turns = max_turns
        self._bridges: dict[str, NemoGymBridge] = {}
        if bridge is not None:
            self.python = python or bridge.python
            self._bridges[str(bridge.python)] = bridge

    def _bridge(self, python: str | os.PathLike[str] | None) -> NemoGymBridge:
        path = str(nemo_gym_python(python or self.python))
        if path not in self._bridges:
            self._bridges[path] = NemoGymBridge(path)
        return self._bridges[path]

    async def __call__(self, base_url: str, sample: Any, request: dict[str, Any]) -> dict[str, Any]:
        """Play one episode; the metadata: ``reward``, ``scores``, ``task``, ``stopped``
        (``done``, ``length``, ``max_turns`` or ``context_full``), ``reward_reason``,
        ``verifier_error``, ``notes``, ``metrics`` and ``response`` (the agent's Responses
        output, as ``/verify`` saw it). A model call the session refuses for its context
        length fails NeMo Gym's whole run: the episode gets reward 0 (``context_full``, not
        verified) and keeps the turns the session recorded.

        Raises:
            ValueError: no row, no resources server, or both kinds of resources server.
            NemoGymError: NeMo Gym failed the episode (the agent's /run answered an error:
                a resources server that fails ``/seed_session`` or ``/verify``, a model call
                that failed otherwise).
        """
        md = dict(getattr(sample, "metadata", None) or {})
        spec = {**self.default, **{k: v for k, v in (md.get("nemo_gym") or {}).items() if v}}
        row = spec.get("row")
        params = row.get("responses_create_params") if isinstance(row, Mapping) else None
        if not isinstance(row, Mapping) or not isinstance(params, Mapping) or "input" not in params:
            raise ValueError(
                "NemoGymAgent needs a task row: sample.metadata['nemo_gym'] = {'row': "
                "{'responses_create_params': {'input': ..., 'tools': [...]}, ...}} (NeMo Gym's "
                "JSONL format)"
            )
        server, url = spec.get("resources_server"), spec.get("resources_url")
        if bool(server) == bool(url):
            raise ValueError(
                "NemoGymAgent needs one resources server: resources_server='file.py:Class' "
                "(served in NeMo Gym's Python) or resources_url='http://host:port'"
            )
        bridge = self._bridge(spec.get("python"))
        if server:
            url = await bridge.serve_resources(str(server), spec.get("resources_config"))
        sampling = {
            "temperature": request.get("temperature"),
            "top_p": request.get("top_p"),
            "max_output_tokens": request.get("max_tokens"),
        }
        row = {
            **row,
            "responses_create_params": {
                **params,
                **{k: v for k, v in sampling.items() if v is not None},
            },
        }
        extra = {k: request[k] for k in ("top_k", "min_p", "stop", "seed") if request.get(k)}
        max_steps = int(md.get("max_turns", self.max_turns))
        out = await bridge.request(
            "run",
            base_url=base_url,
            model=str(spec.get("model") or "policy"),
            row=row,
            resources_url=str(url),
            max_steps=max_steps,
            extra_body=extra,
        )
        task = str(row.get("id", getattr(sample, "label", None) or "nemo_gym"))
        if out.get("context_full"):  # NeMo Gym's loop fails the run: reward 0, turns kept
            why = str(out["context_full"])
            return {
                "reward": 0.0,
                "scores": {"reward": 0.0},
                "stopped": "context_full",
                "task": task,
                "reward_reason": "not verified: the conversation outgrew the context and NeMo "
                f"Gym's agent stopped at the refused model call ({why})",
                "verifier_error": None,
                "notes": [why],
                "response": {},
                "metrics": {"agentic/context_full": 1.0, f"agentic/reward/{task}": 0.0},
            }
        verify = out["verify"]
        response = dict(verify.get("response") or {})
        output = list(response.get("output") or [])
        reward = float(verify["reward"])
        calls = sum(1 for o in output if o.get("type") == "function_call")
        return {
            "reward": reward,
            "scores": {"reward": reward},
            "stopped": _outcome(output, response.get("status"), max_steps),
            "task": task,
            "reward_reason": f"reward {reward:g} from /verify",
            "verifier_error": None,
            "notes": [],
            "response": response,
            "metrics": {
                "agentic/turns": float(_turns(output)),
                "agentic/tool_calls": float(calls),
                f"agentic/reward/{task}": reward,
            },
        }

    async def aclose(self) -> None:
        """End every bridge process (and the resources servers served in it)."""
        bridges, self._bridges = list(self._bridges.values()), {}
        for b in bridges:
            await b.aclose()


nemo_gym_agent = NemoGymAgent()
"""The instance a recipe names (``rollout.agent``); the row and the resources server come
from each sample's ``metadata["nemo_gym"]``."""
