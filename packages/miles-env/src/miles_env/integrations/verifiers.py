"""Prime Intellect Verifiers tasksets as Miles environments, and Verifiers' own rollout loop
against a TITO session.

Verifiers (``pip install verifiers``, its v1 stack) writes an environment as a ``Taskset``
that yields ``Task`` s: the data (a prompt, maybe a system prompt, any fields), the tools
(``Toolset`` MCP servers) and the rubric (``@vf.reward(weight=...)`` functions, judges,
``@vf.metric``). Verifiers pins other versions of openai / mcp / pydantic than Miles, so it
runs in its own Python (``tools/setup_agent_frameworks.sh verifiers``): a bridge process
(``_verifiers_bridge.py``) speaks JSON lines over stdio. Two ways to use it:

- `VerifiersEnv`: the taskset as an `Environment` driven by `run_episode` (Miles plays the
  agent loop): a task (its ``idx`` or ``id``) becomes the prompt messages and the tools, each
  tool call runs the task's toolset, and ``reward`` scores the conversation with the task's
  own rubric: every reward function by name plus ``"reward"``, the weighted total.

      async with VerifiersEnv("my_taskset", pythonpath=["/path/to/envs"]) as env:
          result = await run_episode(env, 0, chat)

- `run_verifiers_rollout` / `VerifiersAgent`: Verifiers' own loop (its chat program,
  interception server and MCP tool servers, then its scoring) with the OpenAI endpoint
  ``base_url`` as the model, as it would call any provider. Give it a TITO session
  (``.../sessions/{id}/v1``) and the session's samples (token ids, loss mask) are the
  training data; ``VerifiersAgent`` is an ``AgentFn`` for ``rollout.agent``::

      rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.verifiers:verifiers_agent"}
      # each sample: label = the task's idx or id, metadata["verifiers"] = {"taskset": ...}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_env.environment.protocol import Observation, StepResult
from miles_env.environment.tools import clip
from miles_env.integrations._bridge import JsonLinesBridge

__all__ = [
    "VerifiersAgent",
    "VerifiersBridge",
    "VerifiersEnv",
    "list_verifiers_tasks",
    "run_verifiers_rollout",
    "verifiers_agent",
]

_BRIDGE = Path(__file__).with_name("_verifiers_bridge.py")


def verifiers_python(python: str | os.PathLike[str] | None = None) -> Path:
    """Verifiers' own Python: ``python``, else ``$MILES_ENV_PYTHON_VERIFIERS``, else the one
    ``tools/setup_agent_frameworks.sh verifiers`` installs."""
    if python is None:
        python = os.environ.get("MILES_ENV_PYTHON_VERIFIERS")
    if python is None:
        cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
        python = cache / "frameworks" / "verifiers" / "bin" / "python"
    path = Path(python)
    if not path.exists():
        raise FileNotFoundError(
            f"Verifiers' Python {path} does not exist: run tools/setup_agent_frameworks.sh "
            "verifiers (or set MILES_ENV_PYTHON_VERIFIERS)"
        )
    return path


class VerifiersError(RuntimeError):
    """The bridge answered a request with an error (the message is Verifiers')."""


def _bridge_env(pythonpath: Sequence[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    return env


def list_verifiers_tasks(
    taskset: str,
    *,
    config: Mapping[str, Any] | None = None,
    python: str | os.PathLike[str] | None = None,
    pythonpath: Sequence[str | os.PathLike[str]] = (),
    timeout_s: float = 300.0,
) -> list[dict[str, Any]]:
    """A taskset's tasks, from outside any event loop (a bridge run once): each ``idx``,
    ``id``, ``name`` and ``messages`` (the prompt as OpenAI messages).

    Raises:
        FileNotFoundError: no Verifiers Python (`verifiers_python`).
        VerifiersError: the taskset does not load (Verifiers' message).
    """
    paths = [str(Path(p).resolve()) for p in pythonpath]
    request = {"id": 0, "op": "load", "taskset": taskset, "config": dict(config or {})}
    proc = subprocess.run(
        [str(verifiers_python(python)), "-P", str(_BRIDGE)],
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
        env=_bridge_env(paths),
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise VerifiersError(
            f"the Verifiers bridge exited ({proc.returncode}) without an answer: "
            f"{proc.stderr.strip()[-2000:]}"
        )
    reply = json.loads(lines[0])
    if not reply["ok"]:
        raise VerifiersError(f"taskset {taskset!r}: {reply['type']}: {reply['error']}")
    return list(reply["result"])


class VerifiersBridge(JsonLinesBridge):
    """The bridge process in Verifiers' Python, with a taskset loaded.

    Args:
        taskset: a Verifiers taskset id (an importable module exporting its ``Taskset``).
        config: fields of the taskset's config.
        python: Verifiers' Python (`verifiers_python`).
        pythonpath: folders to import the taskset from (also for its tool servers).
    """

    def __init__(
        self,
        taskset: str,
        *,
        config: Mapping[str, Any] | None = None,
        python: str | os.PathLike[str] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
    ) -> None:
        super().__init__(verifiers_python(python), _BRIDGE, VerifiersError, "Verifiers")
        self.taskset = taskset
        self.config = dict(config or {})
        self.pythonpath = [str(Path(p).resolve()) for p in pythonpath]
        self.tasks: list[dict[str, Any]] = []

    async def start(self) -> None:
        """Start the process and load the taskset (once)."""
        if await self._spawn(_bridge_env(self.pythonpath)):
            self.tasks = await self.request("load", taskset=self.taskset, config=self.config)

    async def request(self, op: str, **fields: Any) -> Any:
        """Send one request; its result, or `VerifiersError` with Verifiers' message."""
        return await self._send(op, **fields)


class VerifiersEnv:
    """A Verifiers taskset as an `Environment` (module docstring).

    Args:
        taskset, config, python, pythonpath: as `VerifiersBridge`.
        max_output_chars: tool outputs are clipped to about this many characters.

    ``reset`` takes a task's ``idx`` (int) or ``id`` / ``name`` (str). ``info``: ``task``,
    ``tool_calls``, ``tool_errors``, ``tool_s``, ``verify_s``, ``reward_reason``,
    ``weights`` (each reward's weight), ``metrics`` (the task's ``@vf.metric`` values). The
    bridge process lives until `aclose` (``async with``); ``close`` ends the episode.
    """

    def __init__(
        self,
        taskset: str,
        *,
        config: Mapping[str, Any] | None = None,
        python: str | os.PathLike[str] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        max_output_chars: int = 4000,
    ) -> None:
        self.bridge = VerifiersBridge(taskset, config=config, python=python, pythonpath=pythonpath)
        self.max_output_chars = max_output_chars
        self.info: dict[str, Any] = {}

    async def __aenter__(self) -> VerifiersEnv:
        await self.bridge.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def reset(self, task: Any) -> Observation:
        """Start an episode of ``task`` (its idx or id): the prompt and the task's tools."""
        await self.bridge.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        obs = await self.bridge.request("reset", task=task)
        self.info = {
            "task": obs["task"],
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_s": 0.0,
            "setup_s": loop.time() - t0,
            "verify_s": 0.0,
            "reward_reason": "",
            "verifier_error": None,
        }
        return Observation(messages=obs["messages"], tools=obs["tools"])

    async def step(self, tool_calls: list[dict[str, Any]]) -> StepResult:
        """Each call runs in the task's toolset; unknown tools and bad arguments come back as
        ``error: ...`` tool messages."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = (await self.bridge.request("step", calls=tool_calls))["messages"]
        self.info["tool_s"] += loop.time() - t0
        self.info["tool_calls"] += len(out)
        self.info["tool_errors"] += sum(bool(m.pop("error")) for m in out)
        for m in out:
            if isinstance(m["content"], str):
                m["content"] = clip(m["content"], self.max_output_chars)
        return StepResult(messages=out)

    async def reward(self, messages: list[dict[str, Any]] | None = None) -> dict[str, float]:
        """The task's rubric on the conversation: each reward by name, ``"reward"`` the
        weighted total. A rubric that raises gives 0 and the reason (``verifier_error``)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            scored = await self.bridge.request("reward", messages=list(messages or []))
        except VerifiersError as e:
            self.info["verifier_error"] = f"the rubric failed: {e}"
            self.info["reward_reason"] = self.info["verifier_error"]
            return {"reward": 0.0}
        finally:
            self.info["verify_s"] = loop.time() - t0
        return self._scores(scored)

    def _scores(self, scored: Mapping[str, Any]) -> dict[str, float]:
        self.info["weights"] = dict(scored["weights"])
        self.info["metrics"] = dict(scored["metrics"])
        parts = ", ".join(
            f"{k} {v:g} x {scored['weights'].get(k, 1.0):g}"
            for k, v in scored["rewards"].items()
            if v is not None
        )
        self.info["reward_reason"] = f"rubric: {parts or 'no rewards'}"
        scores = {k: float(v) for k, v in scored["rewards"].items() if v is not None}
        scores["reward"] = float(scored["reward"])
        return scores

    async def close(self) -> None:
        """End the episode (its toolsets' teardown runs). Idempotent."""
        if self.bridge.running:
            with contextlib.suppress(VerifiersError):
                await self.bridge.request("close")

    async def aclose(self) -> None:
        """End the episode and the bridge process. Idempotent."""
        await self.close()
        await self.bridge.aclose()


async def run_verifiers_rollout(
    bridge: VerifiersBridge,
    base_url: str,
    task: Any,
    *,
    model: str = "policy",
    max_turns: int | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Verifiers' own loop on ``task`` (idx or id) with ``base_url`` as the model.

    Args:
        bridge: a (started or not) `VerifiersBridge` with the taskset.
        base_url: an OpenAI base URL, e.g. a TITO session's ``.../sessions/{id}/v1``.
        model: the model name sent with each request.
        max_turns: Verifiers' turn limit (None: its default).
        sampling: Verifiers ``SamplingConfig`` fields (``temperature``, ``top_p``,
            ``max_tokens``).

    Returns:
        ``reward`` (weighted total), ``rewards`` (by name), ``weights``, ``metrics``,
        ``task``, ``messages`` (Verifiers' trace, OpenAI format), ``num_turns``,
        ``stop_condition`` and ``errors`` (Verifiers' trace errors, as text).
    """
    await bridge.start()
    return dict(
        await bridge.request(
            "rollout",
            task=task,
            base_url=base_url,
            model=model,
            max_turns=max_turns,
            sampling=dict(sampling or {}),
        )
    )


_SAMPLING_KEYS = ("temperature", "top_p", "max_tokens")


class VerifiersAgent:
    """An ``AgentFn`` (``async agent(base_url, sample, request) -> metadata``): Verifiers'
    loop on the task ``sample.label`` (idx or id) through the session ``base_url``.

    Args:
        taskset, config, python, pythonpath: as `VerifiersBridge`; None ``taskset``: each
            sample's ``metadata["verifiers"]`` names it (``taskset``, ``config``,
            ``pythonpath``, ``python``; what ``task.name: verifiers`` writes). One bridge per
            taskset, shared by the episodes.
        max_turns: Verifiers' turn limit (``metadata["max_turns"]`` wins).
    """

    def __init__(
        self,
        taskset: str | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        python: str | os.PathLike[str] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        max_turns: int | None = 16,
    ) -> None:
        self.default = {
            "taskset": taskset,
            "config": dict(config or {}),
            "pythonpath": list(pythonpath),
        }
        self.python = python
        self.max_turns = max_turns
        self._bridges: dict[str, VerifiersBridge] = {}

    def _bridge(self, spec: Mapping[str, Any]) -> VerifiersBridge:
        if not spec.get("taskset"):
            raise ValueError(
                "VerifiersAgent needs a taskset: VerifiersAgent('my_taskset') or "
                "sample.metadata['verifiers'] = {'taskset': 'my_taskset'}"
            )
        key = json.dumps(spec, sort_keys=True, default=str)
        if key not in self._bridges:
            self._bridges[key] = VerifiersBridge(
                str(spec["taskset"]),
                config=spec.get("config"),
                python=spec.get("python") or self.python,
                pythonpath=spec.get("pythonpath") or (),
            )
        return self._bridges[key]

    async def __call__(self, base_url: str, sample: Any, request: dict[str, Any]) -> dict[str, Any]:
        """Play one episode; the metadata: ``reward``, ``scores``, ``task``, ``stopped``,
        ``reward_reason``, ``verifier_error`` (Verifiers' trace errors), ``notes``,
        ``metrics``."""
        md = dict(getattr(sample, "metadata", None) or {})
        spec = {**self.default, **{k: v for k, v in (md.get("verifiers") or {}).items() if v}}
        turns = md.get("max_turns", self.max_turns)
        out = await run_verifiers_rollout(
            self._bridge(spec),
            base_url,
            sample.label,
            max_turns=None if turns is None else int(turns),
            sampling={k: request[k] for k in _SAMPLING_KEYS if request.get(k) is not None},
        )
        scores = {k: float(v) for k, v in out["rewards"].items() if v is not None}
        scores["reward"] = float(out["reward"])
        metrics = {f"agentic/{k}": float(v) for k, v in out["metrics"].items() if v is not None}
        metrics["agentic/turns"] = float(out["num_turns"])
        metrics[f"agentic/reward/{out['task']}"] = scores["reward"]
        return {
            "reward": scores["reward"],
            "scores": scores,
            "stopped": out["stop_condition"],
            "task": out["task"],
            "reward_reason": f"Verifiers rubric: {scores}",
            "verifier_error": "; ".join(out["errors"]) or None,
            "notes": [],
            "metrics": metrics,
        }

    async def aclose(self) -> None:
        """End every bridge process."""
        bridges, self._bridges = list(self._bridges.values()), {}
        for b in bridges:
            await b.aclose()


verifiers_agent = VerifiersAgent()
"""The instance a recipe names (``rollout.agent``); the taskset comes from each sample's
``metadata["verifiers"]``."""
