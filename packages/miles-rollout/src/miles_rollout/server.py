"""An HTTP server that exposes an :class:`~miles_rollout.Engine` with SGLang's native API.

    handle = serve(engine)            # background thread; handle.url, handle.close()

Field names follow SGLang 0.5.x (``http_server.py`` / ``io_struct.py``); the endpoint table and
what was checked how are in the package README. Errors are JSON ``{"error": {"message": ...}}``
(400 for bad input, 500 otherwise), as SGLang's ``_create_error_response`` shapes them.

Bounds: with ``api_key`` every request but ``GET /health`` needs ``Authorization: Bearer <key>``
(401 otherwise, checked before the body is read; see :mod:`miles_rollout.auth`); a body over
``max_request_mb`` gets 413 and a closed connection (refused on its ``Content-Length`` before any
of it is read; a chunked body once it passes the cap); generate requests beyond the engine's
batch plus ``max_queued_requests`` waiting get 503 with ``Retry-After`` (nothing is queued); a
client that disconnects, and a ``/health_generate`` probe that times out, take their request out
of the engine's queue. Weight payloads must be ``miles_safetensors`` (nothing executable; see
``miles_transfer.push.safe_wire``) unless ``allow_pickle_weights`` admits SGLang's pickled formats.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from miles_rollout._http_generate import parse_generate, response_dict
from miles_rollout._metrics import prometheus_text
from miles_rollout.auth import auth_middleware, check_bind
from miles_rollout.client import ROUTING_KEY_HEADER
from miles_rollout.engine import Engine
from miles_rollout.sampling_params import SamplingParams
from miles_transfer.push import deserialize_named_tensors
from miles_transfer.push.safe_wire import SAFE_FORMAT

__all__ = ["ServerHandle", "serve"]

logger = logging.getLogger(__name__)

_HEALTH_GENERATE_TIMEOUT_S = 20.0
DEFAULT_MAX_REQUEST_MB = 64.0
DEFAULT_MAX_QUEUED_REQUESTS = 1024
RETRY_AFTER_S = 1
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _QuietProbes(logging.Filter):
    """Turn aiohttp's traceback for an unparsable request into one debug line.

    sglang-router probes every worker with HTTP/2 and gRPC prefaces; aiohttp answers 400 and
    carries on, but would log a full traceback at ERROR level for each probe.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            logger.debug("rejected an unparsable request: %s", str(exc).splitlines()[0])
            return False
        return True


_PROBE_FILTER = _QuietProbes()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ValueError as exc:
        return _error(400, str(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        response = _error(
            413,
            f"the request body is larger than this server accepts ({exc.text}); send smaller "
            "batches, or raise the server's --max-request-mb",
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


async def _body(request: web.Request) -> dict[str, Any]:
    # Refused on the header, before a byte of the body is read; a body without a length
    # (chunked) is still capped by client_max_size while it streams in.
    if (request.content_length or 0) > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(request.client_max_size, request.content_length or 0)
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _pop_known(body: dict[str, Any], allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"unknown fields for {endpoint}: {unknown}; allowed: {sorted(allowed)}")


def _overloaded(capacity: int) -> web.Response:
    response = _error(
        503,
        f"the engine's queue is full ({capacity} requests running or waiting); retry after "
        f"{RETRY_AFTER_S} s, lower the client's concurrency, or raise --max-queued-requests",
    )
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


class _Routes:
    """The request handlers; blocking engine calls run in the default executor.

    ``capacity`` bounds the generate requests (prompts) in flight: the engine's batch plus the
    waiting queue. ``pending`` counts them; the event loop thread is the only writer.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queued_requests: int,
        health_generate_timeout_s: float,
        allow_pickle_weights: bool = False,
    ) -> None:
        self.engine = engine
        self.allow_pickle = allow_pickle_weights
        running = engine.config.max_running_requests * engine.dp_size
        self.capacity = running + max_queued_requests
        self.pending = 0
        self.health_generate_timeout_s = health_generate_timeout_s

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def generate(self, request: web.Request) -> web.Response:
        body = await _body(request)
        start = time.monotonic()
        parsed = parse_generate(body, self.engine.tokenizer)
        n = len(parsed.items)
        if self.pending + n > self.capacity:
            return _overloaded(self.capacity)
        # The session key: sglang-router forwards this header; SGLang's own body field is the
        # fallback (the header wins when both are there).
        header_key = request.headers.get(ROUTING_KEY_HEADER)
        futures = []
        self.pending += n
        try:
            for item in parsed.items:
                futures.append(
                    self.engine.submit(
                        item.input_ids,
                        item.sampling_params,
                        return_logprob=item.return_logprob,
                        rid=item.rid,
                        data_parallel_rank=item.data_parallel_rank,
                        routing_key=header_key if header_key is not None else item.routing_key,
                        return_routed_experts=item.return_routed_experts,
                    )
                )
            outs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except BaseException:
            for f in futures:  # a client that went away: out of the engine's queue
                f.cancel()
            raise
        finally:
            self.pending -= n
        latency = time.monotonic() - start
        results = [
            response_dict(out, item, self.engine.tokenizer, latency)
            for out, item in zip(outs, parsed.items)
        ]
        return web.json_response(results if parsed.is_batch else results[0])

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.health() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.engine.health():
            return web.Response(status=503)
        states = self.engine.server_info()["internal_states"]
        if any(st["paused"] or st["num_running_reqs"] for st in states):
            return web.Response(status=200)  # busy or paused: the thread is alive, as SGLang
        if self.pending + 1 > self.capacity:
            return _overloaded(self.capacity)
        fut = self.engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        self.pending += 1
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), self.health_generate_timeout_s)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        finally:
            fut.cancel()  # a probe that timed out (or whose caller left) leaves the queue
            self.pending -= 1
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.engine.server_info()
        # The update_weights_from_tensor formats accepted here (HTTPReceiver picks the first).
        pickled = ["flattened_bucket", None] if self.allow_pickle else []
        info["weight_load_formats"] = [SAFE_FORMAT, *pickled]
        return web.json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.load())

    async def metrics(self, request: web.Request) -> web.Response:
        info = self.engine.server_info()
        return web.Response(
            text=prometheus_text(info["internal_states"]), content_type="text/plain"
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self._run(self.engine.flush_cache)
        text = (
            "Cache flushed.\n"
            if ok
            else "Cache not flushed: there are running or waiting requests.\n"
        )
        return web.Response(text=text, status=200 if ok else 400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        _pop_known(body, {"mode", "rid"}, "/pause_generation")
        mode = body.get("mode") or "abort"  # SGLang's default for the HTTP endpoint
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode must be one of abort, retract, in_place; got {mode!r}")
        await self._run(lambda: self.engine.pause_generation(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._run(self.engine.continue_generation)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        _pop_known(body, {"rid", "abort_all"}, "/abort_request")
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        await self._run(lambda: self.engine.abort_request(rid or None, abort_all=abort_all))
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _body(request)
        allowed = {
            "model_path",
            "load_format",
            "abort_all_requests",
            "weight_version",
            "flush_cache",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
            "recapture_cuda_graph",
            "token_step",
            "rid",
        }
        _pop_known(body, allowed, "/update_weights_from_disk")
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ValueError("model_path (a checkpoint directory) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported here")
        version = body.get("weight_version")
        try:
            await self._run(
                lambda: self.engine.update_weights_from_disk(
                    model_path,
                    weight_version=version,
                    abort_all_requests=bool(body.get("abort_all_requests", False)),
                    flush_cache=bool(body.get("flush_cache", True)),
                )
            )
        except ValueError as exc:
            return web.json_response(
                {"success": False, "message": str(exc), "num_paused_requests": 0}, status=400
            )
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await _body(request)
        allowed = {
            "serialized_named_tensors",
            "load_format",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "disable_draft_model",
            "torch_empty_cache",
            "rid",
        }
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise ValueError("serialized_named_tensors must be a non-empty list (one per TP rank)")
        load_format = body.get("load_format")
        version = body.get("weight_version")
        try:
            # Decode every entry first: each decode releases the sender's in-flight reference
            # on its shared memory, and miles_transfer's sender assumes a 400 means "read".
            decoded = [
                deserialize_named_tensors(
                    p, load_format=load_format, allow_pickle=self.allow_pickle
                )
                for p in payloads
            ]
            _pop_known(body, allowed, "/update_weights_from_tensor")
            if len(decoded) != 1:
                raise ValueError(
                    f"got {len(decoded)} payloads; this server has tp_size 1 (send one payload)"
                )
            named = decoded[0]
            await self._run(
                lambda: self.engine.update_weights_from_tensor(
                    named,
                    weight_version=version,
                    flush_cache=bool(body.get("flush_cache", True)),
                    abort_all_requests=bool(body.get("abort_all_requests", False)),
                )
            )
        except ValueError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        _pop_known(body, {"new_version", "abort_all_requests", "rid"}, "/update_weight_version")
        new_version = body.get("new_version")
        if not isinstance(new_version, str):
            raise ValueError("new_version (a string) is required")
        # Not SGLang's default (abort everything): requests in flight continue unless asked.
        abort = bool(body.get("abort_all_requests", False))
        await self._run(
            lambda: self.engine.update_weight_version(new_version, abort_all_requests=abort)
        )
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {new_version}",
                "new_version": new_version,
            }
        )

    async def weights_checksum(self, request: web.Request) -> web.Response:
        body = await _body(request)
        _pop_known(body, {"names", "served"}, "/weights_checksum")
        names = body.get("names")
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise ValueError("names must be null or a list of parameter names")
        # served: digests of what is served (codes and scales under a quantized weight_format).
        fn = (
            self.engine.served_weights_checksum
            if body.get("served")
            else self.engine.weights_checksum
        )
        return web.json_response(await self._run(lambda: fn(names)))


def build_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    health_generate_timeout_s: float = _HEALTH_GENERATE_TIMEOUT_S,
    allow_pickle_weights: bool = False,
) -> web.Application:
    """The aiohttp application (exposed for embedding in another aiohttp server).

    Arguments as :func:`serve`.
    """
    if not max_request_mb > 0:
        raise ValueError(f"max_request_mb must be > 0, got {max_request_mb}")
    if max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
    r = _Routes(
        engine,
        max_queued_requests=max_queued_requests,
        health_generate_timeout_s=health_generate_timeout_s,
        allow_pickle_weights=allow_pickle_weights,
    )
    # The key is checked first, before anything reads the body.
    app = web.Application(
        middlewares=[auth_middleware(api_key), _errors],
        client_max_size=int(max_request_mb * 2**20),
    )
    get, post = web.get, web.post
    app.add_routes(
        [
            post("/generate", r.generate),
            web.put("/generate", r.generate),
            get("/health", r.health),
            get("/health_generate", r.health_generate),
            get("/get_model_info", r.model_info),
            get("/model_info", r.model_info),
            get("/get_server_info", r.server_info),
            get("/server_info", r.server_info),
            get("/get_load", r.get_load),
            get("/metrics", r.metrics),
            get("/get_weight_version", r.weight_version),
            get("/flush_cache", r.flush_cache),
            post("/flush_cache", r.flush_cache),
            post("/pause_generation", r.pause_generation),
            post("/continue_generation", r.continue_generation),
            post("/abort_request", r.abort_request),
            post("/update_weights_from_disk", r.update_weights_from_disk),
            post("/update_weights_from_tensor", r.update_weights_from_tensor),
            post("/update_weight_version", r.update_weight_version),
            post("/weights_checksum", r.weights_checksum),
        ]
    )
    return app


class ServerHandle:
    """A running server: ``url``, ``host``, ``port`` and :meth:`close`."""

    def __init__(self, host: str, port: int, stop: Callable[[], None]) -> None:
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self._stop = stop
        self._closed = False

    def close(self) -> None:
        """Stop serving (the engine keeps running; shut it down separately)."""
        if not self._closed:
            self._closed = True
            self._stop()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    api_key: str | None = None,
    insecure_no_auth: bool = False,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    health_generate_timeout_s: float = _HEALTH_GENERATE_TIMEOUT_S,
    sock: socket.socket | None = None,
    allow_pickle_weights: bool = False,
) -> ServerHandle:
    """Serve ``engine`` over HTTP from a background thread; return once it accepts requests.

    Args:
        engine: the engine to expose.
        host: the address to bind (loopback by default).
        port: the TCP port; ``0`` picks a free one (see ``handle.port``).
        api_key: require ``Authorization: Bearer <api_key>`` on every request but
            ``GET /health`` (:mod:`miles_rollout.auth`).
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.
        max_request_mb: the largest request body accepted (413 above it).
        max_queued_requests: generate requests that may wait beyond the engine's batch
            (``max_running_requests`` per DP rank); more get 503 with ``Retry-After``.
        health_generate_timeout_s: ``/health_generate`` answers 503 when its one-token
            generation takes longer (and takes it out of the queue).
        sock: an already bound listening socket to serve on instead of ``host:port`` (a caller
            that bound port 0 itself passes the socket on, never the number).
        allow_pickle_weights: also accept SGLang's pickled weight payloads (only from a
            trusted sender: unpickling can be made to open files and sockets).

    Raises:
        ValueError: a non-loopback ``host`` without ``api_key`` or ``insecure_no_auth``, or a
            bad bound.
        OSError: the address cannot be bound (e.g. the port is in use).
    """
    if sock is not None:
        host = sock.getsockname()[0]
    check_bind(host, api_key, insecure_no_auth=insecure_no_auth, what="the engine server")
    app = build_app(
        engine,
        api_key=api_key,
        max_request_mb=max_request_mb,
        max_queued_requests=max_queued_requests,
        health_generate_timeout_s=health_generate_timeout_s,
        allow_pickle_weights=allow_pickle_weights,
    )
    logging.getLogger("aiohttp.server").addFilter(_PROBE_FILTER)  # idempotent (same object)
    if sock is None:
        sock = socket.create_server((host, port))
    bound_port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    # Cancel a generate handler when its client disconnects, so the engine drops the request.
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
        except BaseException as exc:
            failure.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, name=f"miles-http-{bound_port}", daemon=True)
    thread.start()
    started.wait()
    if failure:
        raise failure[0]

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    return ServerHandle(host, bound_port, stop)
