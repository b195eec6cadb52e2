"""The OpenAI chat-completions shapes the session server reads and writes.

Requests are validated field by field (a ``ValueError`` naming the field becomes a 400); the
messages handed to the chat template are clean copies (text content, tool calls with their
function name and arguments). ``stream`` and ``stream_options.include_usage`` choose the
streamed answer (``session.stream``). Fields that would change the result if ignored (``n > 1``,
penalties, ``logit_bias``, a non-text ``response_format``) are refused rather than dropped;
bookkeeping fields (``user``, ``metadata``, ``store``, ...) are ignored. ``top_k`` and ``min_p``
are accepted as extensions (as SGLang's and vLLM's OpenAI servers do).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_rollout.session.tool_parsers import ParsedMessage

__all__ = ["ROLES", "ChatRequest", "chat_completion", "message_key", "parse_chat_request"]

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, Any]

_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(kw_only=True, slots=True)
class ChatRequest:
    """A validated chat-completions request."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    model: str | None = None
    stream: bool = False
    include_usage: bool = False

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls in the output are parsed (not with ``tool_choice: "none"``)."""
        return bool(self.tools) and self.tool_choice != "none"


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"{where}.content[{i}]: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{i}].text must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string, a list of text parts or null")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}")
    args = fn.get("arguments", "{}")
    if not isinstance(args, (str, dict)):
        raise ValueError(f"{where}.function.arguments must be a JSON string or an object")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message(raw: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = raw.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role is {role!r}; allowed roles: {list(ROLES)}")
    content = _text(raw.get("content"), where)
    msg: Message = {"role": role}
    if role == "assistant":
        calls = raw.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        msg["content"] = content or ""
        if calls:
            msg["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        if isinstance(raw.get("reasoning_content"), str):
            msg["reasoning_content"] = raw["reasoning_content"]
        return msg
    if content is None:
        raise ValueError(f"{where} ({role}) needs a string content")
    msg["content"] = content
    for key in ("name", "tool_call_id"):
        if isinstance(raw.get(key), str):
            msg[key] = raw[key]
    return msg


def _schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    bad = [k for k in kinds if k not in _JSON_TYPES]
    if bad:
        raise ValueError(f"{where}.type {kind!r} is not a JSON schema type ({sorted(_JSON_TYPES)})")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError(f"{where}.properties must be an object of schemas")
        for name, sub in props.items():
            _schema(sub, f"{where}.properties.{name}")
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise ValueError(f"{where}.required must be a list of property names")
    items = schema.get("items")
    if items is not None and not isinstance(items, bool):
        for j, sub in enumerate(items if isinstance(items, list) else [items]):
            _schema(sub, f"{where}.items" + (f"[{j}]" if isinstance(items, list) else ""))
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}.enum must be a list")


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise ValueError(
                f"{where}.function.name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}"
            )
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is defined twice")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if "parameters" in fn:
            params = fn["parameters"]
            _schema(params, f"{where}.function.parameters")
            if params.get("type", "object") != "object":
                raise ValueError(f"{where}.function.parameters must be a schema of type 'object'")
    return list(raw) if raw else None


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{key} must be in [{lo}, {hi}], got {value}")
    return float(value)


def _neutral(body: dict[str, Any], key: str, neutral: tuple[Any, ...], why: str) -> None:
    if key in body and body[key] not in neutral:
        raise ValueError(f"{key}={body[key]!r} is not supported: {why}")


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate an OpenAI chat-completions request body.

    Raises:
        ValueError: the first problem found, naming the field.
    """
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ValueError("messages must be a non-empty list")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be none, auto, required or a function by name")
        if name not in {t["function"]["name"] for t in tools or []}:
            raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    elif choice not in (None, "none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {choice!r}")
    if choice not in (None, "none") and not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(
            f"max_tokens / max_completion_tokens must be an integer >= 1, got {max_tokens!r}"
        )
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("stop must be a non-empty string or a list of them")
    top_k = body.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {top_k!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    _neutral(body, "n", (None, 1), "one choice per request (sessions are sequential)")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ValueError(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or not isinstance(
            options.get("include_usage", False), bool
        ):
            raise ValueError('stream_options must be {"include_usage": true|false}')
    _neutral(body, "presence_penalty", (None, 0, 0.0), "the engines do not apply penalties")
    _neutral(body, "frequency_penalty", (None, 0, 0.0), "the engines do not apply penalties")
    _neutral(body, "logit_bias", (None, {}), "the engines do not apply logit biases")
    _neutral(body, "top_logprobs", (None, 0), "only the sampled token's logprob is returned")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ValueError("response_format other than {'type': 'text'} is not supported")
    model = body.get("model")
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        max_tokens=max_tokens,
        stop=stops,
        seed=seed,
        logprobs=bool(body.get("logprobs")),
        model=model if isinstance(model, str) else None,
        stream=bool(stream),
        include_usage=bool((options or {}).get("include_usage")),
    )


def _canonical_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def message_key(msg: Message) -> tuple[Any, ...]:
    """What must stay equal for a stored message to count as unchanged.

    Role, text, tool names with their arguments (as JSON values, so re-serialised arguments
    match) and a tool message's name. Ids and reasoning are not compared: clients rewrite
    them freely and TITO never re-renders a stored message.
    """
    calls = tuple(
        (c["function"]["name"], _canonical_args(c["function"].get("arguments")))
        for c in msg.get("tool_calls") or []
    )
    return (msg["role"], msg.get("content") or "", calls, msg.get("name"))


def chat_completion(
    *,
    model: str,
    parsed: ParsedMessage,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` object for one generated message."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if not parsed.content:
            message["content"] = None
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None if logprobs is None else {"content": logprobs},
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
