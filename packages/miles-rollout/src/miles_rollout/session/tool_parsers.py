"""Tool calls in generated text -> OpenAI ``tool_calls``, one parser per format.

- ``hermes`` (Qwen2.5/Qwen3, Hermes, SmolLM2 with a hermes template): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks anywhere in the text; the rest is the content.
- ``llama3_json`` (Llama 3.1+): the whole message is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (newer
  tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` repeated; the text before it is the content.

A parser never raises on model output: when any call in a message fails to parse, the whole
text comes back as content with no tool calls (``ParsedMessage.error`` says why), so a client
sees what the model wrote and the server never answers 500 for it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PARSERS", "ParsedMessage", "ToolCall", "parse_tool_calls", "split_reasoning"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON object string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    """What a parser made of one generated message."""

    content: str
    tool_calls: list[ToolCall]
    error: str | None = None
    reasoning: str | None = None


class _BadCallError(ValueError):
    pass


def _call(obj: Any, *, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _BadCallError(f"a tool call must be an object with a string 'name', got {obj!r}")
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise _BadCallError(f"arguments of {obj['name']!r} are not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise _BadCallError(f"arguments of {obj['name']!r} must be a JSON object, got {args!r}")
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _BadCallError(f"not JSON: {exc}: {text[:80]!r}") from exc


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = [_call(_loads(m.group(1).strip())) for m in _HERMES_BLOCK.finditer(text)]
    rest = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in rest:
        raise _BadCallError("a <tool_call> block is not closed")
    return rest.strip(), calls


def _llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError as exc:
            raise _BadCallError(f"not JSON at offset {pos}: {exc}") from exc
        calls.append(_call(obj, args_keys=("parameters", "arguments")))
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return "", calls


_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    tail = tail.strip()
    if tail.startswith("["):
        items = _loads(tail)
        if not isinstance(items, list):
            raise _BadCallError("[TOOL_CALLS] must be followed by a JSON list")
        return head.strip(), [_call(item) for item in items]
    calls, decoder = [], json.JSONDecoder()
    for chunk in tail.split("[TOOL_CALLS]"):
        chunk = chunk.strip()
        m = _MISTRAL_NAMED.match(chunk)
        if m is None:
            raise _BadCallError(
                f"expected name[ARGS]{{...}} after [TOOL_CALLS], got {chunk[:80]!r}"
            )
        try:
            args, _ = decoder.raw_decode(chunk, m.end())
        except ValueError as exc:
            raise _BadCallError(f"arguments of {m.group(1)!r} are not JSON: {exc}") from exc
        calls.append(_call({"name": m.group(1), "arguments": args}))
    return head.strip(), calls


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
}


def parse_tool_calls(text: str, parser: str) -> ParsedMessage:
    """Split generated ``text`` into content and tool calls with the named parser.

    Raises:
        ValueError: ``parser`` is not one of ``PARSERS`` (a configuration mistake, not model
            output).
    """
    fn = PARSERS.get(parser)
    if fn is None:
        raise ValueError(f"unknown tool parser {parser!r}; known: {sorted(PARSERS)}")
    try:
        content, calls = fn(text)
    except _BadCallError as exc:
        return ParsedMessage(content=text, tool_calls=[], error=str(exc))
    return ParsedMessage(content=content, tool_calls=calls)


def split_reasoning(text: str, tags: tuple[str, str]) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a reply that opens with a reasoning block.

    The start tag is optional (templates may put it in the generation prompt); without the end
    tag there is no block and the text is returned whole: ``(None, text)``.
    """
    start, end = tags
    head, sep, tail = text.partition(end)
    if not sep:
        return None, text
    head = head.lstrip()
    if head.startswith(start):
        head = head[len(start) :]
    return head.strip(), tail.lstrip()
