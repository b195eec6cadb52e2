"""A HUD environment template as an `Environment`: the template's prompt, the agent's answer,
the template's grade.

HUD (``pip install hud``) writes a task as an ``@env.template`` async generator: it yields a
prompt, receives the agent's answer, and yields a grade (a number, an object with ``.reward``,
or ``{"score": ...}``). This adapter runs the template with HUD's own server-side
``TaskRunner`` (the same start / grade calls HUD's control channel makes), in process: reset
starts it (the prompt is the user message), the agent works through the chat, and ``reward``
sends the agent's last reply as the answer and returns the grade. HUD capabilities (tools over
MCP, workspaces) are not bridged: the episode has no tools.

    env = hud.Environment("arith")

    @env.template(id="add")
    async def add(a: int, b: int):
        answer = yield f"What is {a} + {b}?"
        yield 1.0 if str(a + b) in str(answer) else 0.0

    result = await run_episode(HudTemplateEnv(env), add(a=2, b=3), chat)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles_env.environment.protocol import Observation, StepResult

__all__ = ["HudTemplateEnv"]


def _task_runner() -> Any:
    try:
        from hud.environment.server import TaskRunner
    except ImportError as e:
        raise ImportError("HUD templates need the HUD SDK: pip install 'miles-env[hud]'") from e
    return TaskRunner


class HudTemplateEnv:
    """The templates of a ``hud.Environment`` as an `Environment` (module docstring).

    ``reset`` takes a ``hud.eval.Task`` (what calling a template returns) or a dict
    ``{"template": id, "args": {...}}``. ``info``: ``task``, ``reward_reason``,
    ``verifier_error`` (the template raised while grading), ``grade`` (HUD's grade frame).
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.info: dict[str, Any] = {}
        self._runner: Any = None
        self._task_runner = _task_runner()

    async def reset(self, task: Any) -> Observation:
        """Start the template's generator; its prompt is the user message."""
        await self.close()
        if isinstance(task, Mapping):
            tid, args = str(task.get("template")), dict(task.get("args") or {})
        else:
            tid, args = str(task.id), dict(task.args or {})
        factory = self.env.tasks.get(tid)
        if factory is None:
            raise ValueError(
                f"HUD environment {self.env.name!r} has no template {tid!r}; it has "
                f"{', '.join(sorted(self.env.tasks)) or 'none'}"
            )
        self.info = {"task": tid, "reward_reason": "", "verifier_error": None, "grade": None}
        self._runner = self._task_runner(factory, args)
        frame = await self._runner.start()
        prompt = frame.get("prompt")
        text = prompt if isinstance(prompt, str) else str(prompt)
        return Observation(messages=[{"role": "user", "content": text}], tools=[])

    async def step(self, tool_calls: list[dict[str, Any]]) -> StepResult:
        """The episode has no tools: every call is answered with an error."""
        return StepResult(
            messages=[
                {
                    "role": "tool",
                    "tool_call_id": str(c.get("id") or f"call_{i}"),
                    "content": "error: this task has no tools; answer in plain text",
                }
                for i, c in enumerate(tool_calls)
            ]
        )

    async def reward(self, messages: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """Send the agent's last reply to the template as its answer; the grade is the reward."""
        answer = next(
            (
                str(m.get("content") or "")
                for m in reversed(messages or [])
                if m.get("role") == "assistant"
            ),
            "",
        )
        runner, self._runner = self._runner, None
        if runner is None:
            raise RuntimeError("HudTemplateEnv: call reset(task) first")
        try:
            frame = await runner.grade({"answer": answer})
        except (TypeError, ValueError, RuntimeError) as e:  # the template's own grading bug
            self.info["verifier_error"] = f"template {self.info['task']!r} failed to grade: {e}"
            self.info["reward_reason"] = self.info["verifier_error"]
            return {"reward": 0.0}
        self.info["grade"] = frame
        score = float(frame["score"])
        self.info["reward_reason"] = f"grade {score:g} from template {self.info['task']!r}"
        scores = {"reward": score}
        for k, v in (
            (frame.get("subscores") or {}).items()
            if isinstance(frame.get("subscores"), Mapping)
            else []
        ):
            if isinstance(v, int | float):
                scores[str(k)] = float(v)
        return scores

    async def close(self) -> None:
        """Cancel a template that was not graded (its teardown hooks run). Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cancel()
