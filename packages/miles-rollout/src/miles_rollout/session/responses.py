"""The OpenAI Responses API shapes the session server reads and writes.

A Responses request (``POST /sessions/{id}/v1/responses``) is mapped onto a chat-completions
request and validated by the same code (``protocol.parse_chat_request``), so a Responses turn
goes through the one TITO path: the same template, the same stored-history comparison, the
same ids, masks and logprobs as the chat turn of the same conversation.

Input items become chat messages:

- ``instructions`` -> a ``system`` message in front;
- ``message`` items (``type`` may be left out) -> a message of their role (``developer`` is
  ``system``), content a string or ``input_text`` / ``output_text`` parts;
- ``reasoning`` -> the ``reasoning_content`` of the assistant message that follows;
- an assistant ``message`` and the ``function_call`` items after it -> one assistant message
  with ``tool_calls`` (``call_id`` is the call's id);
- ``function_call_output`` -> a ``tool`` message answering an earlier ``function_call``.

The answer is a ``response`` object whose ``output`` is what the server generated, in the
order OpenAI sends it: a ``reasoning`` item (a reasoning family), a ``message`` item (always
when there is no function call, so a client loop sees the turn end), then one
``function_call`` item per call. Sent back as input, these items map to the stored assistant
message exactly. Stateless: ``previous_response_id``, ``conversation``, ``background`` and
streaming are refused; send the whole conversation in ``input``.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_rollout.session.protocol import ChatRequest, Message, parse_chat_request
from miles_rollout.session.tool_parsers import ParsedMessage

__all__ = ["ResponsesRequest", "parse_responses_request", "response_object"]

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_LOGPROBS = "message.output_text.logprobs"
# Extensions passed to the chat request as they are (SGLang's and vLLM's servers take them).
_EXTENSIONS = ("top_k", "min_p", "seed", "stop")


@dataclass(kw_only=True, slots=True)
class ResponsesRequest:
    """A validated Responses request: the chat request it maps to, and what the response
    echoes back."""

    chat: ChatRequest
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of input_text / output_text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ValueError(
                f"{where}[{j}].type is {kind!r}: only text parts (input_text, output_text) "
                "are supported"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        out.append(part["text"])
    return "".join(out)


def _string(item: dict[str, Any], key: str, where: str, what: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        got = "missing" if value is None else f"{value!r}"
        raise ValueError(f"{where}.{key} is {got}: {what}")
    return value


def _messages(raw: Any, instructions: str | None) -> list[Message]:
    """``input`` (and ``instructions``) as chat messages (module docstring)."""
    out: list[Message] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        return [*out, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ValueError("input must be a string or a non-empty list of items")
    open_turn: Message | None = None  # the assistant message function calls join
    texted = False  # whether open_turn got its message item
    reasoning: str | None = None  # a reasoning item waiting for its assistant message
    calls: set[str] = set()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object (an input item)")
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            raise ValueError(
                f"{where}.type {kind!r} is not supported; the input items this server takes "
                f"are {', '.join(ITEM_TYPES)}"
            )
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = (reasoning or "") + _text(parts, f"{where}.summary")
            open_turn = None
            continue
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise ValueError(
                    f"{where}.role is {item.get('role')!r}; allowed: {', '.join(_ROLES)}"
                )
            text = _text(item.get("content"), f"{where}.content")
            if role != "assistant":
                if reasoning is not None:
                    raise ValueError(f"{where}: a reasoning item must precede assistant output")
                out.append({"role": role, "content": text})
                open_turn = None
                continue
            if open_turn is not None and not texted and not open_turn.get("tool_calls"):
                open_turn["content"] = text
            else:
                open_turn = {"role": "assistant", "content": text}
                out.append(open_turn)
            texted = True
        elif kind == "function_call":
            cid = _string(item, "call_id", where, "a function_call needs its call_id (a string)")
            name = _string(item, "name", where, "a function_call needs the function's name")
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise ValueError(f"{where}.arguments must be a JSON string")
            if open_turn is None:
                open_turn = {"role": "assistant", "content": ""}
                out.append(open_turn)
                texted = False
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            open_turn.setdefault("tool_calls", []).append(call)
            calls.add(cid)
        else:  # function_call_output
            cid = _string(
                item, "call_id", where, "a function_call_output needs the call_id it answers"
            )
            if cid not in calls:
                raise ValueError(
                    f"{where}.call_id {cid!r} answers no function_call before it in input"
                )
            text = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": cid, "content": text})
            open_turn = None
            continue
        if reasoning is not None:
            open_turn["reasoning_content"] = reasoning
            reasoning = None
    if reasoning is not None:
        raise ValueError("input ends with a reasoning item: it must precede assistant output")
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    """Responses function tools (``{"type": "function", "name", ...}``) as chat tools."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("tools must be a list of {'type': 'function', 'name': ...}")
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(
                f"tools[{i}].type is {kind!r}: only function tools are supported "
                "({'type': 'function', 'name': ..., 'parameters': {...}})"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any, tools: list[dict[str, Any]]) -> Any:
    if not tools and raw in ("auto", "none"):
        return None  # Responses clients send the default with no tools; chat would refuse it
    if isinstance(raw, dict):
        if raw.get("type") != "function" or not isinstance(raw.get("name"), str):
            raise ValueError(
                "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}"
            )
        return {"type": "function", "function": {"name": raw["name"]}}
    return raw


def _refuse(body: dict[str, Any], key: str, neutral: tuple[Any, ...], why: str) -> None:
    if body.get(key) not in neutral:
        raise ValueError(f"{key}={body[key]!r} is not supported: {why}")


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a Responses request body and map it onto a chat request (module docstring).

    Raises:
        ValueError: the first problem found, naming the field.
    """
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if "input" not in body:
        raise ValueError("input is missing: a string or a list of input items")
    stateless = "the session server keeps no responses; send the whole conversation in input"
    _refuse(body, "previous_response_id", (None,), stateless)
    _refuse(body, "conversation", (None,), stateless)
    _refuse(body, "prompt", (None,), "stored prompts are not supported; send input")
    _refuse(body, "background", (None, False), "a turn is answered in its request")
    _refuse(body, "stream", (None, False), "Responses turns are not streamed; use stream: false")
    _refuse(body, "max_tool_calls", (None,), "the server does not cap tool calls")
    _refuse(body, "top_logprobs", (None, 0), "only the sampled token's logprob is returned")
    _refuse(body, "truncation", (None, "disabled"), "the server never drops input items")
    text = body.get("text") or {}
    fmt = text.get("format") if isinstance(text, dict) else text
    if fmt is not None and fmt != {"type": "text"}:
        raise ValueError("text.format other than {'type': 'text'} is not supported")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("instructions must be a string")
    max_out = body.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int)):
        raise ValueError(f"max_output_tokens must be an integer >= 1, got {max_out!r}")
    if max_out is not None and max_out < 1:
        raise ValueError(f"max_output_tokens must be an integer >= 1, got {max_out!r}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls must be true or false, got {parallel!r}")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise ValueError("include must be a list of strings")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError("metadata must be an object")
    tools = _tools(body.get("tools"))
    chat_body: dict[str, Any] = {
        "messages": _messages(body["input"], instructions),
        "tools": tools or None,
        "tool_choice": _tool_choice(body.get("tool_choice"), tools),
        "max_tokens": max_out,
        "logprobs": _LOGPROBS in include,
    }
    for key in ("temperature", "top_p", "model", *_EXTENSIONS):
        if key in body:
            chat_body[key] = body[key]
    try:
        chat = parse_chat_request(chat_body)
    except ValueError as exc:  # name the Responses field, not the chat one it maps to
        raise ValueError(re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", str(exc))) from exc
    choice = body.get("tool_choice")
    return ResponsesRequest(
        chat=chat,
        instructions=instructions,
        tools=list(body.get("tools") or []),
        tool_choice="auto" if choice is None else choice,
        parallel_tool_calls=parallel,
        max_output_tokens=max_out,
        metadata=metadata,
    )


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(
    req: ResponsesRequest,
    *,
    model: str,
    parsed: ParsedMessage,
    finish: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An OpenAI ``response`` object for one generated message.

    Args:
        req: the request (its echoed fields).
        model: the model name.
        parsed: the generated message (text, tool calls, reasoning).
        finish: the engine's finish: ``stop`` or ``length`` (cut by ``max_output_tokens``
            or the context: ``status: "incomplete"``).
        prompt_tokens: ids the turn was generated after.
        completion_tokens: ids generated.
        logprobs: the per-token logprobs, when ``include`` asked for them.
    """
    cut = finish == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        summary = [{"type": "summary_text", "text": parsed.reasoning}]
        output.append({"id": _id("rs"), "type": "reasoning", "summary": summary})
    if parsed.content or not parsed.tool_calls:
        part: dict[str, Any] = {"type": "output_text", "text": parsed.content, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append(
            {
                "id": _id("msg"),
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [part],
            }
        )
    for call in parsed.tool_calls:
        output.append(
            {
                "id": _id("fc"),
                "type": "function_call",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    chat = req.chat
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "tool_choice": req.tool_choice,
        "tools": req.tools,
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
