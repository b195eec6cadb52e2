"""The TITO session server: an OpenAI chat endpoint per session that keeps exact token ids.

    handle = serve_sessions("http://127.0.0.1:30000", model_path="./ckpt")
    # agents talk to f"{handle.url}/sessions/{sid}/v1" as an OpenAI base URL
    handle.close()

Endpoints (README "Sessions (TITO)"): ``POST /sessions``, ``POST /sessions/{id}/v1/chat/
completions``, ``POST /sessions/{id}/v1/responses`` (OpenAI's Responses API, mapped onto the
same chat turn: ``session.responses``), ``GET /sessions/{id}/samples``, ``GET /sessions/{id}``,
``DELETE /sessions/{id}``, ``GET /v1/models`` (also under a session), ``GET /health``. Each
turn is one
``/generate`` on the engine with ``input_ids``, logprobs on, and the session id as
``X-SMG-Routing-Key``, so a router keeps a session on one engine (and DP rank).

With ``stream: true`` the turn is generated whole, committed, then sent as OpenAI's
``chat.completion.chunk`` events (``session.stream``); errors come before the stream, as
JSON with their status.

Errors are OpenAI-shaped JSON ``{"error": {"message", "type", "code"}}``: 400 for bad input
(nothing changes in the session), 404 for an unknown session, 409 for a taken session id, 502
when the engine fails, times out or aborts the turn (the session keeps its completed turns).

Bounds: with ``api_key`` every request but ``GET /health`` needs ``Authorization: Bearer <key>``
(401); ``engine_api_key`` is what the server sends to the engine. A body over
``max_request_mb`` gets 413; chat turns beyond ``max_pending_turns`` in flight get 503 with
``Retry-After``; a client that disconnects cancels its turn (and its engine request) before
anything is committed to the session; once the engine has answered, the turn is committed
whole (a client that leaves mid-stream still finds it recorded, and retrying the same request
rolls it back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from miles_rollout.auth import auth_middleware, check_bind
from miles_rollout.client import EngineClient, SGLangClient, SGLangHTTPError
from miles_rollout.sampling_params import SamplingParams
from miles_rollout.session.protocol import ChatRequest, chat_completion, parse_chat_request
from miles_rollout.session.render import TitoRenderer
from miles_rollout.session.responses import parse_responses_request, response_object
from miles_rollout.session.stream import DONE, completion_chunks, sse_event
from miles_rollout.session.tool_parsers import ParsedMessage, parse_tool_calls, split_reasoning
from miles_rollout.session.trajectory import Trajectory

__all__ = [
    "SessionServer",
    "SessionServerHandle",
    "build_session_app",
    "serve_sessions",
    "start_sessions",
]

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
DEFAULT_MAX_REQUEST_MB = 64.0
DEFAULT_MAX_PENDING_TURNS = 1024
RETRY_AFTER_S = 1


class _UpstreamError(Exception):
    """The engine failed the turn (502)."""


class _BusyError(Exception):
    """Too many turns in flight (503 with ``Retry-After``)."""


class _ContextFullError(ValueError):
    """The conversation does not fit the engine's context (400, OpenAI's
    ``context_length_exceeded``, which agent frameworks' clients recognise: LiteLLM raises its
    ContextWindowExceededError, so an agent stops or summarises instead of retrying)."""


def _error(status: int, message: str, code: int | str | None = None) -> web.Response:
    kind = {
        404: "not_found_error",
        409: "conflict_error",
        413: "request_too_large",
        502: "upstream_error",
        503: "overloaded_error",
    }.get(status, "invalid_request_error" if status < 500 else "internal_error")
    body = {"error": {"message": message, "type": kind, "code": status if code is None else code}}
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except _ContextFullError as exc:
        return _error(400, str(exc), "context_length_exceeded")
    except ValueError as exc:
        return _error(400, str(exc))
    except _UpstreamError as exc:
        return _error(502, str(exc))
    except _BusyError as exc:
        response = _error(503, str(exc))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        response = _error(
            413,
            f"the request body is larger than this server accepts ({exc.text}); shorten the "
            "conversation, or raise the session server's --max-request-mb",
        )
        response.force_close()  # the rest of the body stays unread: drop the connection
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # never an HTML stack trace: log it, answer JSON
        logger.exception("request %s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


async def _json_body(request: web.Request) -> Any:
    # Refused on Content-Length before reading; a chunked body is capped while it streams.
    if (request.content_length or 0) > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(request.client_max_size, request.content_length or 0)
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not valid JSON: {exc}") from exc


@dataclass(slots=True)
class _TurnResult:
    """One committed turn, for either API's answer."""

    parsed: ParsedMessage
    finish: str  # the engine's: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None


@dataclass(slots=True)
class _Session:
    id: str
    renderer: TitoRenderer
    samples: list[Trajectory] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.samples.append(Trajectory(renderer=self.renderer))


class _Routes:
    def __init__(
        self,
        client: EngineClient,
        renderer: TitoRenderer,
        *,
        model_name: str,
        context_length: int | None,
        return_routed_experts: bool = False,
        max_pending_turns: int = DEFAULT_MAX_PENDING_TURNS,
    ) -> None:
        self.client = client
        self.max_pending_turns = max_pending_turns
        self.pending_turns = 0
        self.renderer = renderer
        self.model_name = model_name
        self._context_length = context_length
        self._context_known = context_length is not None
        self._extra: dict[str, Any] = (
            {"return_routed_experts": True} if return_routed_experts else {}
        )
        self.sessions: dict[str, _Session] = {}

    def _session(self, request: web.Request) -> _Session:
        sid = request.match_info["sid"]
        session = self.sessions.get(sid)
        if session is None:
            raise web.HTTPNotFound(reason=f"no session {sid!r}")
        return session

    async def context_length(self) -> int | None:
        """The engine's context length, asked once (``None`` if it does not say)."""
        if not self._context_known:
            try:
                info = await self.client.get_server_info()
                value = info.get("context_length")
                if value is None:
                    value = (await self.client.get_model_info()).get("context_length")
            except (SGLangHTTPError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return None  # ask again next turn; the engine still rejects an overlong prompt
            self._context_length = int(value) if isinstance(value, int) else None
            self._context_known = True
        return self._context_length

    async def create(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict) or set(body) - {"session_id"}:
            raise ValueError('the body must be {} or {"session_id": "..."}')
        sid = body.get("session_id") or uuid.uuid4().hex
        if not isinstance(sid, str) or not _SESSION_ID.match(sid):
            raise ValueError(f"session_id must match [A-Za-z0-9_.:-]{{1,128}}, got {sid!r}")
        if sid in self.sessions:
            return _error(409, f"session {sid!r} exists; pick another id or DELETE it first")
        self.sessions[sid] = _Session(sid, self.renderer)
        return web.json_response({"session_id": sid})

    async def info(self, request: web.Request) -> web.Response:
        s = self._session(request)
        current = s.samples[-1]
        return web.json_response(
            {
                "session_id": s.id,
                "num_samples": sum(1 for t in s.samples if t.turns),
                "num_turns": len(current.turns),
                "num_tokens": len(current.tokens),
                "messages": current.messages,
            }
        )

    async def samples(self, request: web.Request) -> web.Response:
        s = self._session(request)
        async with s.lock:  # never export a half-committed turn
            out = [t.to_dict() for t in s.samples if t.turns]
        return web.json_response({"session_id": s.id, "samples": out})

    async def delete(self, request: web.Request) -> web.Response:
        s = self._session(request)
        del self.sessions[s.id]
        return web.json_response({"session_id": s.id, "deleted": True})

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles"}
        return web.json_response({"object": "list", "data": [entry]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        req = parse_chat_request(await _json_body(request))
        turn = await self._queued_turn(s, req)
        reason = "length" if turn.finish == "length" else "stop"
        completion = chat_completion(
            model=self.model_name,
            parsed=turn.parsed,
            finish_reason="tool_calls" if turn.parsed.tool_calls else reason,
            prompt_tokens=turn.prompt_tokens,
            completion_tokens=turn.completion_tokens,
            logprobs=turn.logprobs,
        )
        if not req.stream:
            return web.json_response(completion)
        return await _send_stream(request, completion, include_usage=req.include_usage)

    async def responses(self, request: web.Request) -> web.Response:
        """OpenAI's Responses API: the request mapped onto a chat turn (``session.responses``)."""
        s = self._session(request)
        req = parse_responses_request(await _json_body(request))
        turn = await self._queued_turn(s, req.chat)
        return web.json_response(
            response_object(
                req,
                model=self.model_name,
                parsed=turn.parsed,
                finish=turn.finish,
                prompt_tokens=turn.prompt_tokens,
                completion_tokens=turn.completion_tokens,
                logprobs=turn.logprobs,
            )
        )

    async def _queued_turn(self, s: _Session, req: ChatRequest) -> _TurnResult:
        if self.pending_turns >= self.max_pending_turns:
            raise _BusyError(
                f"{self.pending_turns} chat turns are in flight, the most this server queues; "
                f"retry after {RETRY_AFTER_S} s, lower the agents' concurrency, or raise "
                "--max-pending-turns"
            )
        self.pending_turns += 1
        try:
            async with s.lock:
                return await self._turn(s, req)
        finally:
            self.pending_turns -= 1

    async def _turn(self, s: _Session, req: ChatRequest) -> _TurnResult:
        current = s.samples[-1]
        plan = current.plan(req.messages, req.tools)
        target = Trajectory(renderer=self.renderer) if plan.kind == "new_sample" else current
        input_ids = target.input_ids(plan)
        ctx = await self.context_length()
        max_new = req.max_tokens
        if ctx is not None:
            if len(input_ids) >= ctx:
                raise _ContextFullError(
                    f"This model's maximum context length is {ctx} tokens: the conversation is "
                    f"{len(input_ids)} tokens with this request, over the engine's context "
                    "length; start a new session or shorten it"
                )
            room = ctx - len(input_ids)
            max_new = room if max_new is None else min(max_new, room)
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            max_new_tokens=max_new,
            stop=req.stop,
            seed=req.seed,
        )
        try:
            out = await self.client.generate(
                input_ids, params, return_logprob=True, routing_key=s.id, **self._extra
            )
        except ValueError as exc:  # the engine's 400: nothing was generated
            raise ValueError(f"the engine rejected the turn: {exc}") from exc
        except (SGLangHTTPError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _UpstreamError(
                f"the engine failed the turn ({type(exc).__name__}: {exc}); the session keeps "
                "its completed turns, retry the request"
            ) from exc
        ids = list(out.output_ids)
        finish = out.finish_reason
        if finish.type == "abort":
            raise _UpstreamError(
                f"the engine aborted the turn ({finish.message}); the session keeps its "
                "completed turns, retry the request"
            )
        logprobs = list(out.output_logprobs or [])
        if len(logprobs) != len(ids):
            raise _UpstreamError(
                f"the engine returned {len(ids)} tokens but {len(logprobs)} logprobs"
            )
        versions = getattr(out, "output_weight_versions", None)
        if versions is None or len(versions) != len(ids):
            versions = [out.weight_version] * len(ids)
        parsed = self._parse(ids, finish.matched if finish.type == "stop" else None, req)
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            reply["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if parsed.reasoning is not None:
            reply["reasoning_content"] = parsed.reasoning
        target.commit(
            plan,
            output_ids=ids,
            logprobs=logprobs,
            weight_versions=[str(v) for v in versions],
            reply=reply,
            finish_reason=finish.type,
            routed_experts=getattr(out, "routed_experts", None),
        )
        if plan.kind == "new_sample":
            logger.info("session %s: new sample (%s)", s.id, plan.reason)
            s.samples.append(target)
        lp = None
        if req.logprobs:
            tok = self.renderer.tokenizer
            lp = [
                {"token": tok.decode([t]), "logprob": v, "bytes": None, "top_logprobs": []}
                for t, v in zip(ids, logprobs)
            ]
        return _TurnResult(
            parsed=parsed,
            finish="length" if finish.type == "length" else "stop",
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            logprobs=lp,
        )

    def _parse(self, ids: list[int], matched: Any, req: ChatRequest) -> ParsedMessage:
        body = ids[:-1] if isinstance(matched, int) and ids and ids[-1] == matched else ids
        family = self.renderer.family
        text = self.renderer.tokenizer.decode(body, skip_special_tokens=not family.decode_special)
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]  # OpenAI cuts the text before a stop string
        reasoning = None
        if family.reasoning_tags is not None:
            reasoning, text = split_reasoning(text, family.reasoning_tags)
        if not req.parse_tools:
            return ParsedMessage(content=text, tool_calls=[], reasoning=reasoning)
        parsed = parse_tool_calls(text, family.tool_parser)
        if parsed.error is not None:
            logger.info("unparsed tool call returned as content: %s", parsed.error)
        return dataclasses.replace(parsed, reasoning=reasoning)


async def _send_stream(
    request: web.Request, completion: dict[str, Any], *, include_usage: bool
) -> web.StreamResponse:
    """Send a committed turn as Server-Sent Events (``session.stream``). A client that goes
    away mid-stream leaves the turn recorded whole; retrying the request rolls it back."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await resp.prepare(request)
        for chunk in completion_chunks(completion, include_usage=include_usage):
            await resp.write(sse_event(chunk))
        await resp.write(DONE)
        await resp.write_eof()
    except ConnectionError as exc:
        logger.info("client left mid-stream (%s); the turn stays recorded", exc)
    return resp


def build_session_app(
    client: EngineClient,
    renderer: TitoRenderer,
    *,
    model_name: str = "miles",
    context_length: int | None = None,
    return_routed_experts: bool = False,
    api_key: str | None = None,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    max_pending_turns: int = DEFAULT_MAX_PENDING_TURNS,
) -> web.Application:
    """The aiohttp application (for embedding in another aiohttp server); arguments as
    :func:`serve_sessions`."""
    if not max_request_mb > 0:
        raise ValueError(f"max_request_mb must be > 0, got {max_request_mb}")
    if max_pending_turns < 1:
        raise ValueError(f"max_pending_turns must be >= 1, got {max_pending_turns}")
    r = _Routes(
        client,
        renderer,
        model_name=model_name,
        context_length=context_length,
        return_routed_experts=return_routed_experts,
        max_pending_turns=max_pending_turns,
    )
    app = web.Application(
        middlewares=[auth_middleware(api_key), _errors],
        client_max_size=int(max_request_mb * 2**20),
    )
    app.add_routes(
        [
            web.post("/sessions", r.create),
            web.get("/sessions/{sid}", r.info),
            web.delete("/sessions/{sid}", r.delete),
            web.get("/sessions/{sid}/samples", r.samples),
            web.post("/sessions/{sid}/v1/chat/completions", r.chat),
            web.post("/sessions/{sid}/v1/responses", r.responses),
            web.get("/sessions/{sid}/v1/models", r.models),
            web.get("/v1/models", r.models),
            web.get("/health", r.health),
        ]
    )
    return app


def _renderer(
    tokenizer: Any,
    model_path: str | Path | None,
    template_family: str | None,
    template_kwargs: dict[str, Any] | None,
) -> TitoRenderer:
    if tokenizer is None:
        if model_path is None:
            raise ValueError("pass model_path (the tokenizer's directory) or tokenizer")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    return TitoRenderer(tokenizer, template_family, template_kwargs=template_kwargs)


class SessionServer:
    """A session server running in the caller's event loop (see :func:`start_sessions`)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, client: Any) -> None:
        self._runner: web.AppRunner | None = runner
        self._client = client  # closed with the server when it was made from a URL
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of one session (``.../sessions/{id}/v1``)."""
        return f"{self.url}/sessions/{session_id}/v1"

    async def close(self) -> None:
        """Stop serving (idempotent); an engine client passed in stays open."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            if self._client is not None:
                await self._client.close()


async def start_sessions(
    engine: str | EngineClient,
    model_path: str | Path | None = None,
    *,
    tokenizer: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    template_family: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    engine_timeout_s: float = 600.0,
    context_length: int | None = None,
    model_name: str | None = None,
    return_routed_experts: bool = False,
    api_key: str | None = None,
    engine_api_key: str | None = None,
    insecure_no_auth: bool = False,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    max_pending_turns: int = DEFAULT_MAX_PENDING_TURNS,
) -> SessionServer:
    """Start a session server in the running event loop; ``await server.close()`` to stop.

    For rollouts whose agents run in the same loop (``generate_rollout`` uses it). Arguments
    as :func:`serve_sessions`; pass a loaded ``tokenizer`` (loading one would block the loop).
    """
    check_bind(host, api_key, insecure_no_auth=insecure_no_auth, what="the session server")
    renderer = _renderer(tokenizer, model_path, template_family, template_kwargs)
    name = model_name or (Path(model_path).name if model_path is not None else "miles")
    client = (
        SGLangClient(engine, timeout=engine_timeout_s, api_key=engine_api_key, generate_retries=2)
        if isinstance(engine, str)
        else engine
    )
    app = build_session_app(
        client,
        renderer,
        model_name=name,
        context_length=context_length,
        return_routed_experts=return_routed_experts,
        api_key=api_key,
        max_request_mb=max_request_mb,
        max_pending_turns=max_pending_turns,
    )
    # A client that disconnects cancels its handler, and with it the engine request.
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        sock = socket.create_server((host, port))
    except BaseException:
        await runner.cleanup()
        raise
    try:
        await web.SockSite(runner, sock).start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    own = client if isinstance(engine, str) else None
    return SessionServer(runner, host, sock.getsockname()[1], own)


class SessionServerHandle:
    """A session server on its own thread: ``url``, :meth:`session_url`, :meth:`close`."""

    def __init__(self, server: SessionServer, stop: Callable[[], None]) -> None:
        self.host = server.host
        self.port = server.port
        self.url = server.url
        self._server = server
        self._stop = stop
        self._closed = False

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of one session (``.../sessions/{id}/v1``)."""
        return self._server.session_url(session_id)

    def close(self) -> None:
        """Stop serving and close the engine client it made (an engine passed in stays)."""
        if not self._closed:
            self._closed = True
            self._stop()

    def __enter__(self) -> SessionServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_sessions(
    engine: str | EngineClient,
    model_path: str | Path | None = None,
    *,
    tokenizer: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    template_family: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    engine_timeout_s: float = 600.0,
    context_length: int | None = None,
    model_name: str | None = None,
    return_routed_experts: bool = False,
    api_key: str | None = None,
    engine_api_key: str | None = None,
    insecure_no_auth: bool = False,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    max_pending_turns: int = DEFAULT_MAX_PENDING_TURNS,
) -> SessionServerHandle:
    """Serve TITO sessions from a background thread; return once it accepts requests.

    Args:
        engine: the engine's base URL (an SGLang server, a router, ``miles_rollout.serve``),
            or any :class:`~miles_rollout.EngineClient` usable from another thread's event
            loop (``LocalEngineClient(engine)`` is).
        model_path: the directory of the policy's tokenizer and chat template.
        tokenizer: an already loaded HF tokenizer instead of ``model_path``.
        host: the address to bind (loopback by default).
        port: the TCP port; ``0`` picks a free one.
        template_family: a name from ``session.families.FAMILIES``; ``None`` detects it.
        template_kwargs: extra chat-template variables (e.g. ``{"enable_thinking": False}``).
        engine_timeout_s: the most seconds one engine call may take (then 502).
        context_length: the engine's context length; ``None`` asks the engine.
        model_name: the name in ``/v1/models`` and completions (default: the directory name).
        return_routed_experts: MoE engines (R3): ask each turn for the routed experts and
            export them with the sample (needs an engine client whose ``generate`` takes
            ``return_routed_experts``).
        api_key: require ``Authorization: Bearer <api_key>`` on every request but
            ``GET /health`` (:mod:`miles_rollout.auth`).
        engine_api_key: the key sent to the engine when ``engine`` is a URL.
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.
        max_request_mb: the largest request body accepted (413 above it).
        max_pending_turns: chat turns in flight at most (waiting for their session or the
            engine); more get 503 with ``Retry-After``.

    Raises:
        ValueError: no tokenizer, no chat template, a family that does not fit it, or a
            non-loopback ``host`` without ``api_key`` or ``insecure_no_auth``.
        OSError: the address cannot be bound.
    """
    check_bind(host, api_key, insecure_no_auth=insecure_no_auth, what="the session server")
    renderer = _renderer(tokenizer, model_path, template_family, template_kwargs)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    result: list[Any] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                start_sessions(
                    engine,
                    model_path,
                    tokenizer=renderer.tokenizer,
                    host=host,
                    port=port,
                    template_family=renderer.family.name,
                    template_kwargs=template_kwargs,
                    engine_timeout_s=engine_timeout_s,
                    context_length=context_length,
                    model_name=model_name,
                    return_routed_experts=return_routed_experts,
                    api_key=api_key,
                    engine_api_key=engine_api_key,
                    insecure_no_auth=insecure_no_auth,
                    max_request_mb=max_request_mb,
                    max_pending_turns=max_pending_turns,
                )
            )
        except BaseException as exc:
            result.append(exc)
            started.set()
            loop.close()
            return
        result.append(server)
        started.set()
        loop.run_forever()
        loop.run_until_complete(server.close())
        loop.close()

    thread = threading.Thread(target=run, name="miles-sessions", daemon=True)
    thread.start()
    started.wait()
    if isinstance(result[0], BaseException):
        raise result[0]

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    return SessionServerHandle(result[0], stop)
