"""The Environment protocol: what a rollout driver needs from an agentic environment.

An episode is ``reset(task)`` (the prompt messages and the tools the agent may call), then
``step(tool_calls)`` for every assistant turn that calls tools (the tool messages to append,
and whether the episode is over), then ``reward()`` (named scores, ``"reward"`` among them),
then ``close()``. Messages and tool calls are OpenAI chat-completions dicts, so any agent loop
that speaks that format (a TITO session, an agent framework, a scripted policy) can drive any
environment. ``info`` collects per-episode facts (timings, errors, why it ended) that the
driver returns with the reward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Environment",
    "Observation",
    "StepResult",
    "ToolArgumentsError",
    "function_tool",
    "parse_arguments",
]


@dataclass(kw_only=True, slots=True)
class Observation:
    """What ``reset`` gives the agent.

    Attributes:
        messages: the opening chat messages (system and user), OpenAI format.
        tools: the tools the agent may call, as OpenAI ``{"type": "function", "function":
            {...}}`` entries with a JSON-schema ``parameters`` object.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What ``step`` gives back for one assistant turn's tool calls.

    Attributes:
        messages: the messages to append, in order: one ``{"role": "tool", "tool_call_id",
            "content"}`` per call (an environment may add a user message after them).
        done: the episode is over (the agent asked to finish, or the environment says so).
    """

    messages: list[dict[str, Any]]
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; every method is a coroutine except ``info``.

    ``reset`` may acquire resources (a sandbox), which ``close`` releases; a driver calls
    ``close`` whatever happened (``run_episode`` does).
    """

    info: dict[str, Any]

    async def reset(self, task: Any) -> Observation:
        """Start an episode of ``task`` (a task directory, a dataset row, ...)."""
        ...

    async def step(self, tool_calls: list[dict[str, Any]]) -> StepResult:
        """Run the tool calls of one assistant turn (OpenAI ``tool_calls`` entries)."""
        ...

    async def reward(self, messages: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Score the episode: named scores, the main one under ``"reward"``.

        ``messages`` is the whole conversation (graders that read the agent's final answer
        need it); environments that judge their own state ignore it.
        """
        ...

    async def close(self) -> None:
        """Release what ``reset`` acquired. Idempotent."""
        ...


class ToolArgumentsError(ValueError):
    """A tool call's arguments are not what the tool takes (the message says what is)."""


def function_tool(
    name: str, description: str, properties: Mapping[str, Any], required: list[str]
) -> dict[str, Any]:
    """An OpenAI function tool with a JSON-schema object of ``properties``."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": dict(properties),
                "required": list(required),
            },
        },
    }


def parse_arguments(call: Mapping[str, Any], tool: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of an OpenAI tool call, checked against the tool's schema.

    Checks that the arguments are a JSON object, that every required property is there and
    that string / integer / number / boolean properties have that type; unknown properties
    are refused (a misspelt name would otherwise be silently ignored).

    Raises:
        ToolArgumentsError: the message names the problem and what the tool takes.
    """
    fn = call.get("function") or {}
    raw = fn.get("arguments", "{}")
    schema = tool["function"]["parameters"]
    props: dict[str, Any] = schema.get("properties", {})
    takes = ", ".join(
        f"{k}: {v.get('type', 'any')}{'' if k in schema.get('required', []) else '?'}"
        for k, v in props.items()
    )
    if isinstance(raw, str):
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise ToolArgumentsError(
                f"arguments are not valid JSON ({e}); it takes {{{takes}}}"
            ) from e
    else:
        args = raw
    if not isinstance(args, dict):
        raise ToolArgumentsError(
            f"arguments must be a JSON object, got {type(args).__name__}; it takes {{{takes}}}"
        )
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        raise ToolArgumentsError(f"missing argument {', '.join(missing)}; it takes {{{takes}}}")
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise ToolArgumentsError(f"unknown argument {', '.join(unknown)}; it takes {{{takes}}}")
    for k, v in args.items():
        want = props[k].get("type")
        if want and not _has_type(v, want):
            raise ToolArgumentsError(
                f"argument {k} must be {want}, got {type(v).__name__}; it takes {{{takes}}}"
            )
    return args


def _has_type(value: Any, json_type: str) -> bool:
    if json_type == "string":
        return isinstance(value, str)
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if json_type == "boolean":
        return isinstance(value, bool)
    return True
