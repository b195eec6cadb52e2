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

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = [
    "API_KEY_ENV",
    "OPEN_PATHS",
    "auth_headers",
    "auth_middleware",
    "check_bind",
    "is_loopback",
    "resolve_api_key",
]

API_KEY_ENV = "MILES_API_KEY"
OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a key (GET only): liveness probes that reveal and change nothing."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def resolve_api_key(
    explicit: str | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """The key to use: ``explicit``, else ``$MILES_API_KEY``, else ``None`` (no auth).

    Raises:
        ValueError: a key that is empty or holds whitespace or non-ASCII characters (it could
            not travel in an HTTP header unchanged).
    """
    env = os.environ if env is None else env
    key = explicit if explicit is not None else env.get(API_KEY_ENV) or None
    if key is None:
        return None
    if not key or not key.isascii() or any(c.isspace() for c in key) or not key.isprintable():
        raise ValueError(
            f"the API key must be non-empty printable ASCII without spaces (got {len(key)} "
            f"characters); set --api-key or {API_KEY_ENV} to such a string, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}``, or ``{}`` without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(host: str, api_key: str | None, *, insecure_no_auth: bool, what: str) -> None:
    """Refuse to serve on a non-loopback address without an API key.

    Raises:
        ValueError: ``host`` is reachable from other machines, no key is set and
            ``insecure_no_auth`` is False (the message names both fixes).
    """
    if api_key is None and not insecure_no_auth and not is_loopback(host):
        raise ValueError(
            f"{what} would listen on {host}, reachable from other machines, without an API key: "
            f"anyone could drive it. Set --api-key (or {API_KEY_ENV}; clients send it as "
            "'Authorization: Bearer <key>'), bind --host 127.0.0.1, or pass --insecure-no-auth "
            "on a trusted network"
        )


def _authorized(request: web.Request, expected: bytes) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    # Compare bytes of the same encoding; compare_digest's time does not depend on where the
    # first difference is (only on the lengths).
    return hmac.compare_digest(token.strip().encode("utf-8", "replace"), expected)


def auth_middleware(api_key: str | None) -> Middleware:
    """An aiohttp middleware that answers 401 unless the request carries ``api_key``.

    Without a key it lets everything through. The 401 body is JSON in SGLang's error shape
    (``{"error": {"message", "code"}}``) with a ``WWW-Authenticate: Bearer`` header.
    """
    expected = api_key.encode() if api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None:
            return await handler(request)
        if request.method in ("GET", "HEAD") and request.path in OPEN_PATHS:
            return await handler(request)
        if not _authorized(request, expected):
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
