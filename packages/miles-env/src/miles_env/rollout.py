"""Agentic episodes in an RL rollout: the agent function, the reward, the per-step metrics.

A recipe of ``miles train`` runs Harbor tasks as multi-turn episodes through the TITO session
server (every turn token-faithful, tool outputs masked out of the loss)::

    rollout: {generate_fn: multi_turn, agent: "miles_env.rollout:terminal_agent"}
    task:    {reward_fn: "miles_env.rollout:episode_reward"}

Each sample's ``label`` is a task directory and its ``metadata`` may hold ``env`` (the fields
of `TerminalEnvConfig`, e.g. ``{"toolset": "coding"}``) and ``max_turns``. Samples are read by
attribute only (``label``, ``metadata``), so this module needs no rollout package.

Per step the rollout logs the mean of each number in ``sample.metadata["metrics"]``:
``rollout/agentic/turns``, ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
``nonzero_exits``, ``generate_s``, ``sandbox_s``, ``sandbox_frac``, ``episode_s``,
``max_turns_hit``, ``context_full``, ``verifier_error``, ``reward`` and ``reward/<task>``.
"""

from __future__ import annotations

from typing import Any

from miles_env.environment.chat import OpenAIChat
from miles_env.environment.episode import run_episode
from miles_env.environment.terminal import TerminalEnv

__all__ = [
    "DEFAULT_MAX_TURNS",
    "EpisodeError",
    "episode_reward",
    "terminal_agent",
]

DEFAULT_MAX_TURNS = 16


class EpisodeError(RuntimeError):
    """The episode has no trustworthy reward (its verifier failed, or it never ran)."""


async def terminal_agent(base_url: str, sample: Any, request: dict[str, Any]) -> dict[str, Any]:
    """An ``AgentFn``: play the Harbor task ``sample.label`` through the chat endpoint
    ``base_url`` (one TITO session) in a fresh sandbox, closed at the end.

    Args:
        base_url: the session's OpenAI base URL (``.../sessions/{id}/v1``).
        sample: ``label`` is the task directory; ``metadata["env"]`` configures
            `TerminalEnv`, ``metadata["max_turns"]`` bounds the replies.
        request: chat fields sent with every call (temperature, max_tokens, ...).

    Returns:
        For ``sample.metadata``: ``reward``, ``scores``, ``stopped``, ``task``,
        ``reward_reason``, ``verifier_error``, ``notes`` and ``metrics``.

    Raises:
        TaskError: the task directory is incomplete (the sample fails with the reason).
        ChatError: the endpoint failed other than by a full context.
    """
    md = sample.metadata
    env = TerminalEnv(md.get("env"))
    max_turns = int(md.get("max_turns", DEFAULT_MAX_TURNS))
    async with OpenAIChat(base_url, request=request) as chat:
        result = await run_episode(env, sample.label, chat, max_turns=max_turns)
    return result.to_metadata()


def episode_reward(sample: Any) -> float:
    """A ``RewardFn``: the verifier's reward the agent function recorded.

    Raises:
        EpisodeError: the verifier failed (crashed, hung, wrote no reward): the run's
            ``task.reward_errors`` policy decides (drop the sample, train it at 0, or stop);
            or the sample has no episode (its generate function is not an episode agent).
    """
    md = sample.metadata
    if md.get("verifier_error"):
        raise EpisodeError(f"task {md.get('task')!r}: {md['verifier_error']}")
    if "reward" not in md:
        raise EpisodeError(
            "the sample has no episode reward: generate it with an episode agent "
            "(rollout.generate_fn: multi_turn, rollout.agent: miles_env.rollout:terminal_agent)"
        )
    return float(md["reward"])
