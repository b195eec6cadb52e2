"""The NeMo Gym side of `miles_env.integrations.nemo_gym`'s `NemoGymAgent`: run in NeMo Gym's
own Python (3.12).

    python -P _nemo_gym_bridge.py   # -P: this folder must not shadow NeMo Gym's packages

It reads one JSON request per line on stdin and writes one JSON reply per line on stdout
(``{"id", "ok", "result"}`` or ``{"id", "ok": false, "error", "type"}``); anything NeMo Gym
prints goes to stderr. Requests (``op``):

- ``serve_resources``: ``server`` (a ``SimpleResourcesServer`` subclass: ``"file.py:Class"``
  or ``"module:Class"``, e.g. one of NeMo Gym's ``resources_servers.*.app``) and ``config``
  (its config fields): served on loopback in this process, once per (server, config), as
  NeMo Gym serves it (uvicorn, session middleware, liveness, exception middleware); answers
  ``url``.
- ``run``: one episode as NeMo Gym's rollout collection runs it: ``POST /run`` of NeMo Gym's
  own ``simple_agent`` (``responses_api_agents.simple_agent``: ``/seed_session`` on the
  resources server, then the agent's Responses loop, tools as ``POST /<name>`` on the
  resources server, then ``/verify``) whose model server is NeMo Gym's ``openai_model``
  (``responses_api_models.openai_model``) pointed at ``base_url``, an OpenAI endpoint, with
  ``model`` and ``extra_body``; ``row`` is the task row (``responses_create_params`` and the
  fields ``/verify`` reads), ``resources_url`` the resources server, ``max_steps`` the
  agent's model-call limit. The agent and model servers are made for the episode (the model
  server's base URL is the episode's) and stopped after it. Answers ``verify`` (the
  resources server's verify response: ``reward``, ``response``, ...), or ``context_full``
  (the endpoint's message) when the endpoint refused a model call with OpenAI's
  ``context_length_exceeded``: NeMo Gym's agent then fails the whole ``/run``.

Requests run concurrently (replies carry the request's ``id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import re
import socket
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import uvicorn
from nemo_gym.config_types import BaseServerConfig, ModelServerRef, ResourcesServerRef
from nemo_gym.server_utils import (
    GlobalAIOHTTPAsyncClientConfig,
    ServerClient,
    is_global_aiohttp_client_setup,
    set_global_aiohttp_client,
)
from omegaconf import OmegaConf
from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from responses_api_models.openai_model.app import SimpleModelServer, SimpleModelServerConfig

_OUT = sys.stdout
sys.stdout = sys.stderr  # what NeMo Gym or a server prints must not corrupt the replies
_HOST = "127.0.0.1"
# The session server's wording (OpenAI's), inside the error texts NeMo Gym's servers nest.
_CONTEXT_MESSAGE = re.compile(r"maximum context length is \d+ tokens(?:[^\"'\\]|\\*')*")
_resources: dict[str, str] = {}
_serving = asyncio.Lock()


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: several servers share this process, and the
    bridge ends when its stdin closes."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


_servers: list[tuple[_Server, asyncio.Task[None]]] = []


def _socket() -> socket.socket:
    return socket.create_server((_HOST, 0))


async def _serve(server: Any, sock: socket.socket) -> tuple[_Server, asyncio.Task[None]]:
    """Serve a NeMo Gym server's app on ``sock`` as ``run_webserver`` sets it up."""
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    http = _Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("uvicorn stopped before it served")
        await asyncio.sleep(0.005)
    return http, task


async def _stop(http: _Server, task: asyncio.Task[None]) -> None:
    http.should_exit = True
    await task


def _entry(name: str, host: str, port: int | str, kind: str) -> dict[str, Any]:
    return {name: {kind: {"x": {"host": host, "port": int(port)}}}}


def _client(servers: dict[str, Any]) -> ServerClient:
    """A ServerClient that finds servers by name in ``servers`` (NeMo Gym's global config
    shape: name -> server type -> config), without a head server."""
    return ServerClient(
        head_server_config=BaseServerConfig(host=_HOST, port=0),
        global_config_dict=OmegaConf.create(servers),
    )


def _server_class(spec: str) -> Any:
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ValueError(f"server must be 'file.py:Class' or 'module:Class', got {spec!r}")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"no resources server file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"_ng_{path.stem}", path)
        assert mod_spec is not None
        assert mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module  # pydantic resolves the models' annotations here
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"{where} has no class {attr!r}")
    return cls


async def serve_resources(server: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    key = json.dumps([server, config or {}], sort_keys=True)
    async with _serving:  # concurrent first episodes start one server, not several
        if key not in _resources:
            _resources[key] = await _start_resources(server, config or {})
    return {"url": _resources[key]}


async def _start_resources(server: str, config: dict[str, Any]) -> str:
    cls = _server_class(server)
    cls.model_rebuild()  # a module with postponed annotations leaves them unresolved
    config_cls = cls.model_fields["config"].annotation
    sock = _socket()
    port = sock.getsockname()[1]
    fields = {"name": "resources", "host": _HOST, "port": port, "entrypoint": server, **config}
    instance = cls(config=config_cls.model_validate(fields), server_client=_client({}))
    _servers.append(await _serve(instance, sock))
    return f"http://{_HOST}:{port}"


async def run(
    *,
    base_url: str,
    model: str,
    row: dict[str, Any],
    resources_url: str,
    max_steps: int | None = None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    res = urlsplit(resources_url)
    if res.hostname is None or res.port is None:
        raise ValueError(f"resources_url must be http://host:port, got {resources_url!r}")
    model_sock, agent_sock = _socket(), _socket()
    model_port, agent_port = model_sock.getsockname()[1], agent_sock.getsockname()[1]
    client = _client(
        {
            **_entry("policy_model", _HOST, model_port, "responses_api_models"),
            **_entry("resources", res.hostname, res.port, "resources_servers"),
            **_entry("agent", _HOST, agent_port, "responses_api_agents"),
        }
    )
    model_server = SimpleModelServer(
        config=SimpleModelServerConfig(
            name="policy_model",
            host=_HOST,
            port=model_port,
            entrypoint="app.py",
            openai_base_url=base_url.rstrip("/"),
            openai_api_key="miles",  # the session endpoint takes no key; the client sends one
            openai_model=model,
            extra_body=dict(extra_body or {}),
        ),
        server_client=client,
    )
    agent = SimpleAgent(
        config=SimpleAgentConfig(
            name="agent",
            host=_HOST,
            port=agent_port,
            entrypoint="app.py",
            resources_server=ResourcesServerRef(type="resources_servers", name="resources"),
            model_server=ModelServerRef(type="responses_api_models", name="policy_model"),
            max_steps=max_steps,
        ),
        server_client=client,
    )
    started: list[tuple[_Server, asyncio.Task[None]]] = []
    try:
        started.append(await _serve(model_server, model_sock))
        started.append(await _serve(agent, agent_sock))
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http,
            http.post(f"http://{_HOST}:{agent_port}/run", json=row) as resp,
        ):
            text = await resp.text()
            if resp.status != 200 and "context_length_exceeded" in text:
                why = _CONTEXT_MESSAGE.search(text)
                said = why.group(0).replace("\\", "") if why else text[:2000]
                return {"context_full": f"the {said}"}
            if resp.status != 200:
                raise RuntimeError(f"NeMo Gym's agent /run: HTTP {resp.status}: {text[:2000]}")
            return {"verify": json.loads(text)}
    finally:
        await asyncio.gather(*(_stop(*served) for served in started))


async def _handle(req: dict[str, Any], out: asyncio.Lock) -> None:
    rid = req.get("id")
    try:
        fields = {k: v for k, v in req.items() if k not in ("id", "op")}
        if req["op"] == "serve_resources":
            result: Any = await serve_resources(**fields)
        elif req["op"] == "run":
            result = await run(**fields)
        else:
            raise ValueError(f"unknown op {req['op']!r}")
        reply = {"id": rid, "ok": True, "result": result}
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        reply = {"id": rid, "ok": False, "error": str(exc), "type": type(exc).__name__}
    async with out:
        _OUT.write(json.dumps(reply, default=str) + "\n")
        _OUT.flush()


async def main() -> None:
    if not is_global_aiohttp_client_setup():  # NeMo Gym's client, without its global config
        set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    loop = asyncio.get_running_loop()
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
    await asyncio.gather(*(_stop(*served) for served in _servers))


if __name__ == "__main__":
    asyncio.run(main())
    sys.stderr.flush()
    _OUT.flush()
    os._exit(0)  # NeMo Gym's exit hooks and module teardown take about a second; all is done
