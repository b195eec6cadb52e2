"""API keys for the HTTP servers: ``Authorization: Bearer <key>``, as SGLang and its router do.

One key protects every server of a deployment (the engine server, the TITO session server, the
fleet's engines and router): ``--api-key`` on each command, else ``MILES_API_KEY`` in the
environment, else the recipe's ``rollout.api_key``. Every request is checked in constant time
(``hmac.compare_digest``); a missing or wrong key gets HTTP 401 and nothing else happens.

The one exception is ``GET /health``: it answers an empty 200/503 and changes nothing, and
sglang-router probes it on every worker (SGLang itself also leaves ``/health*`` and ``/metrics``
open; Miles leaves only ``/health`` open, since ``/health_generate`` runs a generation and
``/metrics`` tells an outsider the load).

A server bound to an address other than loopback must have a key: :func:`check_bind` refuses to
start without one unless ``insecure_no_auth`` (``--insecure-no-auth``) says so explicitly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from miles_transfer.auth import (
    API_KEY_ENV,
    auth_headers,
    bearer_ok,
    check_bind,
    is_loopback,
    resolve_api_key,
)

__all__ = [
    "API_KEY_ENV",
    "OPEN_PATHS",
    "auth_headers",
    "auth_middleware",
    "check_bind",
    "is_loopback",
    "resolve_api_key",
]

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a key (GET only): liveness probes that reveal and change nothing."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(api_key: str | None) -> Middleware:
    """An aiohttp middleware that answers 401 unless the request carries ``api_key``.

    Without a key it lets everything through. The 401 body is JSON in SGLang's error shape
    (``{"error": {"message", "code"}}``) with a ``WWW-Authenticate: Bearer`` header.
    """
    expected = api_key or None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None:
            return await handler(request)
        if request.method in ("GET", "HEAD") and request.path in OPEN_PATHS:
            return await handler(request)
        if not bearer_ok(request.headers.get("Authorization"), expected):
            body = {
                "error": {
                    "message": "missing or wrong API key: send 'Authorization: Bearer <key>' "
                    f"(the server's --api-key / {API_KEY_ENV})",
                    "type": "authentication_error",
                    "code": 401,
                }
            }
            return web.json_response(
                body, status=401, headers={"WWW-Authenticate": 'Bearer realm="miles"'}
            )
        return await handler(request)

    return middleware
