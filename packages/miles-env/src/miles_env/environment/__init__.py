"""Environments for agentic RL: the protocol, Harbor tasks as environments, the episode driver.

- `Environment`: ``reset(task) -> Observation(messages, tools)``, ``step(tool_calls) ->
  StepResult(messages, done)``, ``reward() -> {"reward": ..., ...}``, ``close()``.
- `TerminalEnv`: a Harbor task directory, one sandbox per episode, ``bash`` (or the coding
  tool set) run in it, the task's verifier as the reward.
- `run_episode(env, task, chat)`: drives an environment with any OpenAI-style chat function
  (`OpenAIChat` for an endpoint such as a TITO session).
"""

from miles_env.environment.chat import ChatError, ContextFullError, OpenAIChat
from miles_env.environment.episode import ChatFn, EpisodeResult, run_episode
from miles_env.environment.protocol import (
    Environment,
    Observation,
    StepResult,
    ToolArgumentsError,
    function_tool,
    parse_arguments,
)
from miles_env.environment.terminal import TerminalEnv, TerminalEnvConfig
from miles_env.environment.tools import TOOLSETS

__all__ = [
    "TOOLSETS",
    "ChatError",
    "ChatFn",
    "ContextFullError",
    "Environment",
    "EpisodeResult",
    "Observation",
    "OpenAIChat",
    "StepResult",
    "TerminalEnv",
    "TerminalEnvConfig",
    "ToolArgumentsError",
    "function_tool",
    "parse_arguments",
    "run_episode",
]
