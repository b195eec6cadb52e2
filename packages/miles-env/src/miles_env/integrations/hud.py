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

`HudAgent` is the other way round: HUD's own agent loop (``OpenAIChatAgent``, HUD's episode
driver ``hud.eval.run.rollout``, the environment served on loopback by ``LocalRuntime``) with
an OpenAI endpoint as its provider, as it would call any provider. Give it a TITO session
(``.../sessions/{id}/v1``) and the session's samples (token ids, loss mask) are the training
data; HUD's grade is the reward. HUD pins other versions of openai / mcp / pydantic than
Miles, so the loop runs in HUD's own Python (``tools/setup_agent_frameworks.sh hud``) behind
a bridge process (``_hud_bridge.py``, JSON lines over stdio). ``hud_agent`` is an
``AgentFn`` for ``rollout.agent``::

    rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.hud:hud_agent"}
    # each sample: label = the template id,
    # metadata["hud"] = {"source": "env.py", "env": "arith", "args": {"a": 2, "b": 3}}

``task.name: hud`` (``miles.agentic.HudTaskSet``) makes such samples from an environment's task
rows, which `list_hud_tasks` reads in HUD's Python.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_env.environment.protocol import Observation, StepResult
from miles_env.integrations._bridge import JsonLinesBridge

__all__ = [
    "HudAgent",
    "HudBridge",
    "HudError",
    "HudTemplateEnv",
    "hud_agent",
    "hud_python",
    "list_hud_tasks",
]


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


_BRIDGE = Path(__file__).with_name("_hud_bridge.py")


def hud_python(python: str | os.PathLike[str] | None = None) -> Path:
    """HUD's own Python: ``python``, else ``$MILES_ENV_PYTHON_HUD``, else the one
    ``tools/setup_agent_frameworks.sh hud`` installs.

    Raises:
        FileNotFoundError: that Python does not exist (the message names the fix).
    """
    if python is None:
        python = os.environ.get("MILES_ENV_PYTHON_HUD")
    if python is None:
        cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
        python = cache / "frameworks" / "hud" / "bin" / "python"
    path = Path(python)
    if not path.exists():
        raise FileNotFoundError(
            f"HUD's Python {path} does not exist: run tools/setup_agent_frameworks.sh hud "
            "(or set MILES_ENV_PYTHON_HUD)"
        )
    return path


class HudError(RuntimeError):
    """The bridge answered a request with an error (the message is HUD's)."""


class HudBridge(JsonLinesBridge):
    """The bridge process in HUD's Python (`_hud_bridge.py`); episodes run concurrently.

    Args:
        python: HUD's Python (`hud_python`).
    """

    def __init__(self, python: str | os.PathLike[str] | None = None) -> None:
        super().__init__(hud_python(python), _BRIDGE, HudError, "HUD")

    async def start(self) -> None:
        """Start the process (once)."""
        await self._spawn()

    async def request(self, op: str, **fields: Any) -> Any:
        """Send one request (starting the process); its result, or `HudError`."""
        await self.start()
        return await self._send(op, **fields)


def list_hud_tasks(
    source: str | os.PathLike[str],
    *,
    env: str | None = None,
    taskset: str | os.PathLike[str] | None = None,
    python: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """The task rows of a HUD taskset, from outside any event loop (a bridge run once).

    Args:
        source: the HUD environment (a ``.py`` file, a folder of them, or a module).
        env: its name, when the source declares several.
        taskset: where the rows are (HUD's ``Taskset.from_file``: a ``.py`` file or folder
            declaring ``hud.eval.Task`` rows, or a JSON / JSONL file); None: ``source``.
        python: HUD's Python (`hud_python`).
        timeout_s: the most seconds the bridge may take.

    Returns:
        ``name`` (the environment's), ``templates`` (id -> description) and ``rows`` (each
        ``slug``, ``env``, ``id`` (the template) and ``args``).

    Raises:
        FileNotFoundError: no HUD Python (the message names the setup command).
        HudError: HUD could not load the environment or the rows (HUD's message).
    """
    request = {"id": 0, "op": "tasks", "source": _source(source), "env": env}
    request["taskset"] = None if taskset is None else str(Path(taskset).resolve())
    proc = subprocess.run(
        [str(hud_python(python)), "-P", str(_BRIDGE)],
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise HudError(
            f"the HUD bridge exited ({proc.returncode}) without an answer: "
            f"{proc.stderr.strip()[-2000:]}"
        )
    reply = json.loads(lines[0])
    if not reply["ok"]:
        raise HudError(f"{reply['type']}: {reply['error']}")
    return dict(reply["result"])


def _source(source: str | os.PathLike[str]) -> str:
    """A source path made absolute (the bridge runs elsewhere); a module name as is."""
    path = Path(source)
    return str(path.resolve()) if path.exists() else str(source)


def _reason(reward: float, task: str, grade: Mapping[str, Any]) -> str:
    why = grade.get("content")
    return f"HUD grade {reward:g} for template {task!r}" + (f": {why}" if why else "")


# OpenAI's client takes these as arguments; the other sampling fields go in the body.
_OPENAI_KEYS = ("temperature", "top_p", "max_tokens", "stop")
_BODY_KEYS = ("top_k", "min_p")


class HudAgent:
    """An ``AgentFn`` (``async agent(base_url, sample, request) -> metadata``): HUD's
    ``OpenAIChatAgent`` plays the template ``sample.label`` of a HUD environment through
    the session ``base_url``; HUD grades the answer.

    Args:
        source: the HUD environment: a ``.py`` file (or a folder of them, or a module) that
            declares it; None: each sample's ``metadata["hud"]["source"]``.
        env: its name, when the source declares several.
        python: HUD's Python (`hud_python`); one bridge process per Python.
        max_turns: HUD's ``max_steps`` (``metadata["max_turns"]`` wins).
        runtime: ``"local"`` (the environment served in the bridge, one episode at a
            time per environment: HUD's ``LocalRuntime``) or ``"subprocess"`` (a child
            per episode, concurrent: ``SubprocessRuntime``).
        timeout_s: HUD's rollout timeout (None: none).

    ``metadata["hud"]`` may set ``source``, ``env``, ``args`` (the template's arguments),
    ``runtime`` and ``system_prompt``.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | None = None,
        *,
        env: str | None = None,
        python: str | os.PathLike[str] | None = None,
        max_turns: int = 16,
        runtime: str = "local",
        timeout_s: float | None = None,
    ) -> None:
        if runtime not in ("local", "subprocess"):
            raise ValueError(f"HudAgent runtime must be 'local' or 'subprocess', got {runtime!r}")
        self.default = {
            "source": None if source is None else str(source),
            "env": env,
            "runtime": runtime,
        }
        self.python = python
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self._bridges: dict[str, HudBridge] = {}

    def _bridge(self, python: str | os.PathLike[str] | None) -> HudBridge:
        path = str(hud_python(python or self.python))
        if path not in self._bridges:
            self._bridges[path] = HudBridge(path)
        return self._bridges[path]

    async def __call__(self, base_url: str, sample: Any, request: dict[str, Any]) -> dict[str, Any]:
        """Play one episode; the metadata: ``reward``, ``scores``, ``task`` (``metadata["task"]``
        (a `HudTaskSet` row's slug), else the template), ``stopped``,
        ``reward_reason``, ``verifier_error`` (HUD could not grade), ``grade`` (HUD's grade
        frame), ``notes`` (the trace's errors) and ``metrics``.

        Raises:
            ValueError: no environment source.
            HudError: HUD failed the episode before it ran (unknown template, bad args).
        """
        md = dict(getattr(sample, "metadata", None) or {})
        spec = {**self.default, **(md.get("hud") or {})}
        if not spec.get("source"):
            raise ValueError(
                "HudAgent needs a HUD environment: HudAgent('env.py') or "
                "sample.metadata['hud'] = {'source': 'env.py'}"
            )
        kwargs: dict[str, Any] = {k: request[k] for k in _OPENAI_KEYS if request.get(k) is not None}
        body = {k: request[k] for k in _BODY_KEYS if request.get(k) is not None}
        if body:
            kwargs["extra_body"] = body
        out = await self._bridge(spec.get("python")).request(
            "rollout",
            source=_source(spec["source"]),
            env=spec.get("env"),
            template=str(sample.label),
            args=dict(spec.get("args") or {}),
            base_url=base_url,
            model=str(spec.get("model") or "policy"),
            max_steps=int(md.get("max_turns", self.max_turns)),
            completion_kwargs=kwargs,
            system_prompt=spec.get("system_prompt"),
            runtime=str(spec["runtime"]),
            timeout_s=self.timeout_s,
        )
        template = str(sample.label)
        task = str(md.get("task") or template)  # a taskset's row slug, else the template
        grade = dict(out["grade"] or {})
        reward = float(out["reward"])
        verifier_error = None if out["graded"] else f"HUD did not grade: {grade.get('content')}"
        scores = {"reward": reward}
        for sub in grade.get("subscores") or []:
            if isinstance(sub, Mapping) and isinstance(sub.get("value"), int | float):
                scores[str(sub.get("name"))] = float(sub["value"])
        return {
            "reward": reward,
            "scores": scores,
            "stopped": out["stop_reason"] or out["status"],
            "task": task,
            "grade": grade,
            "reward_reason": verifier_error or _reason(reward, template, grade),
            "verifier_error": verifier_error,
            "notes": list(out["errors"]),
            "metrics": {
                "agentic/turns": float(out["turns"]),
                "agentic/tool_calls": float(out["tool_calls"]),
                f"agentic/reward/{task}": reward,
            },
        }

    async def aclose(self) -> None:
        """End every bridge process."""
        bridges, self._bridges = list(self._bridges.values()), {}
        for b in bridges:
            await b.aclose()


hud_agent = HudAgent()
"""The instance a recipe names (``rollout.agent``); the environment comes from each
sample's ``metadata["hud"]``."""
