"""An OpenAI chat-completions client for episode drivers (a TITO session, or any provider).

    chat = OpenAIChat("http://127.0.0.1:8000/sessions/abc/v1", request={"max_tokens": 256})
    reply = await chat(messages, tools)        # choices[0].message, as a dict

Uses aiohttp (``pip install 'miles-env[rollout]'``), imported when the first client is made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["API_KEY_ENV", "ChatError", "ContextFullError", "OpenAIChat"]

# The key the project's servers demand (miles_rollout.auth): sent as a bearer token when set.
API_KEY_ENV = "MILES_API_KEY"


class ChatError(RuntimeError):
    """The chat endpoint answered with an error (or not at all)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"chat completion failed (HTTP {status}): {message}")
        self.status = status
        self.message = message


class ContextFullError(ChatError):
    """The conversation no longer fits the model's context: the episode cannot go on."""


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError as e:
        raise ImportError(
            "the episode driver's chat client needs aiohttp: pip install 'miles-env[rollout]' "
            "(or pip install aiohttp)"
        ) from e
    return aiohttp


class OpenAIChat:
    """``async chat(messages, tools) -> assistant message`` over an OpenAI-compatible endpoint.

    Args:
        base_url: the OpenAI base URL (``.../v1``); requests go to ``{base_url}/chat/completions``.
        request: fields sent with every call (``temperature``, ``max_tokens``, ``model``, ...).
        api_key: bearer token; ``None`` reads ``$MILES_API_KEY`` (no header when unset).
        timeout_s: the most seconds one call may take.

    Attributes:
        calls: completed calls.
        finish_reasons: the ``finish_reason`` of each completed call.
        completion_tokens: generated tokens over all calls (from ``usage``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        request: Mapping[str, Any] | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.request = dict(request or {})
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout_s = timeout_s
        self.calls = 0
        self.finish_reasons: list[str] = []
        self.completion_tokens = 0
        self._aiohttp = _aiohttp()
        self._http: Any = None

    async def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """One chat completion; returns ``choices[0].message``.

        Raises:
            ContextFullError: HTTP 400 saying the conversation is over the context length.
            ChatError: any other error status, or the endpoint unreachable.
        """
        aiohttp = self._aiohttp
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers
            )
        body = {**self.request, "messages": messages}
        if tools:
            body["tools"] = tools
        try:
            async with self._http.post(self.url, json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise ChatError(None, f"{type(e).__name__}: {e} ({self.url})") from e
        if status != 200:
            message = _error_message(raw)
            if status == 400 and "context length" in message:
                raise ContextFullError(status, message)
            raise ChatError(status, message)
        data = json.loads(raw)
        choice = data["choices"][0]
        self.calls += 1
        self.finish_reasons.append(str(choice.get("finish_reason")))
        self.completion_tokens += int((data.get("usage") or {}).get("completion_tokens") or 0)
        return dict(choice["message"])

    async def close(self) -> None:
        """Close the HTTP connection pool. Idempotent."""
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> OpenAIChat:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _error_message(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:500]
    if isinstance(err, dict):
        return str(err.get("message", err))[:500]
    return str(err)[:500]
