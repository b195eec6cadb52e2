"""Drive one episode: an `Environment` and a chat function that plays the agent.

    async with OpenAIChat(session_base_url, request={"max_tokens": 512}) as chat:
        result = await run_episode(TerminalEnv(), "path/to/task", chat, max_turns=16)
    result.reward, result.metrics["turns"], result.stopped

``chat(messages, tools) -> assistant message`` is any OpenAI-style chat call: a TITO session
(every turn token-faithful, tool outputs masked out of the loss), a provider, a scripted
policy. The loop: reset, then per turn ask the chat for a reply, run its tool calls, append
the tool messages; it stops when a reply calls no tool (the agent is done), the environment
says done, the context is full, or after ``max_turns`` replies (an agent that never stops).
Then the reward, and the environment is closed whatever happened.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles_env.environment.chat import ContextFullError
from miles_env.environment.protocol import Environment

__all__ = ["STOP_REASONS", "ChatFn", "EpisodeResult", "run_episode"]

ChatFn = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Awaitable[dict[str, Any]]]
"""``async chat(messages, tools) -> assistant message`` (OpenAI dict, maybe with tool_calls)."""

STOP_REASONS = ("done", "env_done", "max_turns", "context_full")


@dataclass(kw_only=True, slots=True)
class EpisodeResult:
    """How an episode went.

    Attributes:
        reward: the main score (``scores["reward"]``).
        scores: every named score of the environment's ``reward()``.
        stopped: why the loop ended: ``"done"`` (a reply without tool calls), ``"env_done"``,
            ``"max_turns"`` or ``"context_full"``.
        messages: the whole conversation (prompt, replies, tool messages).
        metrics: numbers per episode: ``turns``, ``tool_calls``, ``tool_errors``,
            ``tool_timeouts``, ``nonzero_exits``, ``generate_s`` (in chat calls),
            ``sandbox_s`` (sandbox setup, tools, verifier, close), ``sandbox_frac`` (of the
            two), ``episode_s``,
            ``max_turns_hit``, ``context_full``, ``verifier_error`` (0 / 1 flags) and
            ``reward``.
        info: the environment's ``info`` (task name, reasons, notes).
    """

    reward: float
    scores: dict[str, float]
    stopped: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, Any]:
        """What an agent function returns for ``sample.metadata``: ``reward``, ``scores``,
        ``stopped``, ``task``, ``reward_reason``, ``verifier_error``, ``notes`` and
        ``metrics``: the metrics as ``agentic/<name>`` plus ``agentic/reward/<task>`` (the
        rollout logs the mean of each over a step's samples, ``rollout/agentic/...``)."""
        task = self.info.get("task")
        metrics = {f"agentic/{k}": v for k, v in self.metrics.items()}
        if task:
            metrics[f"agentic/reward/{task}"] = self.reward
        return {
            "reward": self.reward,
            "scores": dict(self.scores),
            "stopped": self.stopped,
            "task": task,
            "reward_reason": self.info.get("reward_reason", ""),
            "verifier_error": self.info.get("verifier_error"),
            "notes": list(self.info.get("notes", [])),
            "metrics": metrics,
        }


_SANDBOX_PARTS = ("setup_s", "tool_s", "verify_s", "close_s")
_COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "nonzero_exits")


async def run_episode(
    env: Environment, task: Any, chat: ChatFn, *, max_turns: int = 16
) -> EpisodeResult:
    """Play one episode of ``task`` in ``env`` with ``chat`` as the agent (module docstring).

    Args:
        env: the environment (``close()`` is called whatever happens).
        task: what ``env.reset`` takes.
        chat: ``async chat(messages, tools) -> assistant message``.
        max_turns: the most assistant replies; an agent still calling tools then is stopped
            and judged on what it did.

    Raises:
        Whatever ``env.reset`` raises for a bad task (e.g. ``TaskError``) and chat errors other
        than a full context: the episode has no result, and its sandbox is closed.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    t_start = time.monotonic()
    generate_s = 0.0
    turns = 0
    stopped = "max_turns"
    messages: list[dict[str, Any]] = []
    try:
        obs = await env.reset(task)
        messages = list(obs.messages)
        for _ in range(max_turns):
            t0 = time.monotonic()
            try:
                reply = await chat(messages, obs.tools)
            except ContextFullError:
                stopped = "context_full"
                break
            finally:
                generate_s += time.monotonic() - t0
            turns += 1
            messages.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                stopped = "done"
                break
            result = await env.step(list(calls))
            messages.extend(result.messages)
            if result.done:
                stopped = "env_done"
                break
        scores = await env.reward(messages)
    finally:
        await env.close()
    info = env.info
    sandbox_s = sum(float(info.get(k, 0.0)) for k in _SANDBOX_PARTS)
    metrics: dict[str, float] = {
        "turns": float(turns),
        **{k: float(info.get(k, 0)) for k in _COUNTERS},
        "generate_s": generate_s,
        "sandbox_s": sandbox_s,
        "sandbox_frac": sandbox_s / (sandbox_s + generate_s) if sandbox_s + generate_s else 0.0,
        "episode_s": time.monotonic() - t_start,
        "max_turns_hit": float(stopped == "max_turns"),
        "context_full": float(stopped == "context_full"),
        "verifier_error": float(bool(info.get("verifier_error"))),
        "reward": float(scores.get("reward", 0.0)),
    }
    return EpisodeResult(
        reward=float(scores.get("reward", 0.0)),
        scores=dict(scores),
        stopped=stopped,
        messages=messages,
        metrics=metrics,
        info=dict(info),
    )
