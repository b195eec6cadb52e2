"""API keys for Miles' servers and the P2P mesh (standard library only).

One key protects a deployment: ``--api-key`` on each command, else ``MILES_API_KEY`` in the
environment. HTTP servers check ``Authorization: Bearer <key>`` in constant time on every request
but ``GET /health`` (401 otherwise); the P2P mesh proves the key on every connection with an
HMAC challenge (the key never travels). A server bound to a non-loopback address without a key
refuses to start unless ``insecure_no_auth`` says so explicitly. miles-rollout's servers use the
same rules (``miles_rollout.auth``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping

__all__ = [
    "API_KEY_ENV",
    "auth_headers",
    "bearer_ok",
    "check_bind",
    "is_loopback",
    "resolve_api_key",
]

API_KEY_ENV = "MILES_API_KEY"


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


def bearer_ok(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key`` (constant-time compare:
    the time does not depend on where a wrong key first differs)."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    return hmac.compare_digest(token.strip().encode("utf-8", "replace"), api_key.encode())


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
