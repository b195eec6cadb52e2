"""A Harbor task as an `Environment`: one sandbox per episode, tools run in it, the task's
verifier pays.

    env = TerminalEnv(TerminalEnvConfig(toolset="coding"))
    obs = await env.reset("path/to/task")        # sandbox up, instruction + tools
    out = await env.step(reply["tool_calls"])    # tool messages
    scores = await env.reward()                  # runs tests/test.sh: {"reward": 1.0, ...}
    await env.close()                            # always (run_episode does)

The agent's time is bounded twice: each command by ``command_timeout_s``, all of them together
by the task's ``[agent] timeout_sec`` (then ``step`` says ``done`` and the verifier judges what
the agent left).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.environment.protocol import Observation, StepResult
from miles_env.environment.tools import TOOLSETS, run_tool
from miles_env.harbor.check import open_task_sandbox, verify
from miles_env.harbor.task import HarborTask, load_task
from miles_env.sandbox import BACKENDS, Sandbox

__all__ = ["DEFAULT_SYSTEM_PROMPT", "TerminalEnv", "TerminalEnvConfig", "initial_messages"]

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent working in a Linux sandbox. Your working directory is {workdir}. "
    "Use the tools ({tools}) to inspect and change files and run commands; each bash call "
    "starts a fresh shell in {workdir}. When the task is done, reply with a short summary and "
    "no tool call."
)


@dataclass(kw_only=True, slots=True)
class TerminalEnvConfig:
    """How a `TerminalEnv` runs its episodes.

    Attributes:
        toolset: ``"bash"`` (one shell tool: terminal tasks) or ``"coding"`` (``bash``,
            ``read_file``, ``write_file``, ``edit_file``).
        backend: the sandbox backend (``"local"``: bubblewrap; ``"podman"``; a cloud one).
        backend_options: passed to ``create_sandbox``.
        podman_base: podman only: a local image to build each task's Dockerfile FROM.
        command_timeout_s: the most seconds one ``bash`` call may run.
        max_output_chars: tool outputs are clipped to about this many characters (the
            context is the scarce resource of a multi-turn episode).
        system_prompt: the system message; ``{workdir}`` and ``{tools}`` are filled in.
            ``None``: `DEFAULT_SYSTEM_PROMPT`; ``""``: no system message.
    """

    toolset: str = "bash"
    backend: str = "local"
    backend_options: dict[str, Any] = field(default_factory=dict)
    podman_base: str | None = None
    command_timeout_s: float = 60.0
    max_output_chars: int = 4000
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.toolset not in TOOLSETS:
            raise ValueError(f"toolset must be one of {sorted(TOOLSETS)}, got {self.toolset!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if not self.command_timeout_s > 0:
            raise ValueError(f"command_timeout_s must be > 0, got {self.command_timeout_s}")
        if self.max_output_chars < 100:
            raise ValueError(f"max_output_chars must be >= 100, got {self.max_output_chars}")

    @classmethod
    def coerce(cls, value: TerminalEnvConfig | Mapping[str, Any] | None) -> TerminalEnvConfig:
        """A config from itself, a dict of its fields, or ``None`` (the defaults)."""
        if isinstance(value, TerminalEnvConfig):
            return value
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"a TerminalEnvConfig or a dict of its fields, got {value!r}")
        data = dict(value or {})
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown TerminalEnvConfig field {', '.join(unknown)}; valid: "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        return cls(**data)


def initial_messages(
    task: HarborTask, config: TerminalEnvConfig | Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The opening messages of an episode of ``task``: the system prompt (unless it is
    ``""``) and the task's instruction as the user message."""
    cfg = TerminalEnvConfig.coerce(config)
    names = ", ".join(tool["function"]["name"] for tool in TOOLSETS[cfg.toolset])
    prompt = DEFAULT_SYSTEM_PROMPT if cfg.system_prompt is None else cfg.system_prompt
    messages: list[dict[str, Any]] = []
    if prompt:
        messages.append(
            {"role": "system", "content": prompt.format(workdir=task.workdir, tools=names)}
        )
    messages.append({"role": "user", "content": task.instruction.strip()})
    return messages


class TerminalEnv:
    """A Harbor task directory as an `Environment` (see the module docstring).

    ``info`` holds the episode's facts: ``task``, counters ``tool_calls``, ``tool_errors``
    (calls that could not run: unknown tool, bad arguments, missing file), ``tool_timeouts``,
    ``nonzero_exits``; seconds ``setup_s`` (sandbox up), ``tool_s``, ``verify_s``,
    ``close_s``; ``reward_reason``, ``verifier_error`` (a reason, or None) and ``notes``.
    """

    def __init__(self, config: TerminalEnvConfig | Mapping[str, Any] | None = None) -> None:
        self.config = TerminalEnvConfig.coerce(config)
        self.tools = TOOLSETS[self.config.toolset]
        self.info: dict[str, Any] = {}
        self._task: HarborTask | None = None
        self._sb: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox | None:
        """The episode's sandbox (None before reset and after close)."""
        return self._sb

    async def reset(self, task: str | Path | HarborTask) -> Observation:
        """Load the task (a directory or a loaded `HarborTask`) and start its sandbox.

        Raises:
            TaskError: the task directory is incomplete or invalid (the message names what).
        """
        await self.close()
        t = task if isinstance(task, HarborTask) else load_task(task)
        self._task = t
        self.info = {
            "task": t.name,
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_timeouts": 0,
            "nonzero_exits": 0,
            "setup_s": 0.0,
            "tool_s": 0.0,
            "verify_s": 0.0,
            "close_s": 0.0,
            "reward_reason": "",
            "verifier_error": None,
            "notes": [],
        }
        t0 = time.monotonic()
        try:
            self._sb = await open_task_sandbox(
                t,
                backend=self.config.backend,
                backend_options=self.config.backend_options,
                podman_base=self.config.podman_base,
                notes=self.info["notes"],
            )
        finally:
            self.info["setup_s"] = time.monotonic() - t0
        return Observation(
            messages=initial_messages(t, self.config), tools=[dict(tool) for tool in self.tools]
        )

    async def step(self, tool_calls: list[dict[str, Any]]) -> StepResult:
        """Run one turn's tool calls in order; ``done`` once the task's agent time is spent."""
        sb, task = self._require()
        out: list[dict[str, Any]] = []
        info = self.info
        for i, call in enumerate(tool_calls):
            left = task.agent_timeout_s - info["tool_s"]
            if left <= 0:
                content = f"error: the task's agent time ({task.agent_timeout_s:g} s) is spent"
                info["tool_errors"] += 1
            else:
                r = await run_tool(
                    sb,
                    call,
                    self.tools,
                    timeout_s=min(self.config.command_timeout_s, left),
                    max_chars=self.config.max_output_chars,
                )
                content = r.content
                info["tool_s"] += r.seconds
                info["tool_errors"] += int(r.error)
                info["tool_timeouts"] += int(r.timed_out)
                info["nonzero_exits"] += int(r.exit_code not in (None, 0))
            info["tool_calls"] += 1
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(call.get("id") or f"call_{i}"),
                    "content": content,
                }
            )
        done = info["tool_s"] >= task.agent_timeout_s
        if done:
            info["notes"].append(f"agent time ({task.agent_timeout_s:g} s) spent")
        return StepResult(messages=out, done=done)

    async def reward(self, messages: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Run the task's verifier on what the agent left; ``{"reward": ..., ...}``.

        A verifier that crashes, hangs or writes no reward gives ``{"reward": 0.0}`` and its
        reason in ``info["verifier_error"]``.
        """
        sb, task = self._require()
        verdict = await verify(sb, task)
        self.info["verify_s"] = verdict.duration_s
        self.info["reward_reason"] = verdict.reason
        self.info["verifier_error"] = verdict.reason if verdict.error else None
        return dict(verdict.scores)

    async def close(self) -> None:
        """Destroy the episode's sandbox (and everything running in it). Idempotent."""
        sb, self._sb = self._sb, None
        if sb is not None:
            t0 = time.monotonic()
            try:
                await sb.close()
            finally:
                self.info["close_s"] = time.monotonic() - t0

    def _require(self) -> tuple[Sandbox, HarborTask]:
        if self._sb is None or self._task is None:
            raise RuntimeError("TerminalEnv: call reset(task) first (or the episode is closed)")
        return self._sb, self._task
