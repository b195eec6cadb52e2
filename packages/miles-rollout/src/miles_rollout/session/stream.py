"""A finished chat completion as OpenAI's streamed form: ``chat.completion.chunk`` events.

The session server generates a turn whole (the engine call does not stream), commits it to the
session, then sends it as Server-Sent Events in the order OpenAI's API does, so agent
frameworks that always stream read it with their usual code:

1. ``delta: {"role": "assistant", "content": ""}`` (``null`` for a tool-call-only reply);
2. ``reasoning_content`` deltas (a reasoning family), then ``content`` deltas (at most
   ``PIECE_CHARS`` characters each);
3. per tool call ``i``: ``{"index": i, "id", "type": "function", "function": {"name",
   "arguments": ""}}``, then ``{"index": i, "function": {"arguments": ...}}``;
4. ``delta: {}`` with ``finish_reason`` (and ``logprobs.content`` for the whole turn when
   asked);
5. with ``stream_options.include_usage``: ``choices: []`` and ``usage`` (every earlier chunk
   carries ``usage: null``), as OpenAI sends it;
6. ``data: [DONE]``.

Concatenating the deltas gives back the non-streamed message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["DONE", "PIECE_CHARS", "completion_chunks", "sse_event"]

PIECE_CHARS = 32
DONE = b"data: [DONE]\n\n"


def _pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), PIECE_CHARS):
        yield text[i : i + PIECE_CHARS]


def completion_chunks(completion: dict[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of one ``chat.completion`` (module docstring)."""
    (choice,) = completion["choices"]
    message = choice["message"]
    head = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
    }
    if include_usage:
        head["usage"] = None

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        entry = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
        return {**head, "choices": [entry]}

    out = [chunk({"role": "assistant", "content": "" if message["content"] is not None else None})]
    out += [
        chunk({"reasoning_content": p}) for p in _pieces(message.get("reasoning_content") or "")
    ]
    out += [chunk({"content": p}) for p in _pieces(message.get("content") or "")]
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        first = {"index": i, "id": call["id"], "type": "function"}
        first["function"] = {"name": fn["name"], "arguments": ""}
        out.append(chunk({"tool_calls": [first]}))
        out.append(
            chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        )
    out.append(chunk({}, finish_reason=choice["finish_reason"], logprobs=choice.get("logprobs")))
    if include_usage:
        out.append({**head, "choices": [], "usage": completion["usage"]})
    return out


def sse_event(chunk: dict[str, Any]) -> bytes:
    """One ``data: ...`` Server-Sent Event."""
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
