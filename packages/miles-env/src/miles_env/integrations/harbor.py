"""Harbor's own agents on Harbor tasks, with a TITO session as their model provider.

Harbor (``pip install harbor``, Python 3.12: ``tools/setup_agent_frameworks.sh harbor``) runs a
*trial*: it builds the task's ``environment/`` image, starts it (here: Harbor's ``podman``
environment, through ``podman-compose``), lets one of its agents work in it, then runs the
task's ``tests/test.sh`` and reads the reward it wrote. `run_harbor_trial` runs one trial (what
``harbor trial start`` does: Harbor's ``Trial.create`` and ``run``) in Harbor's own Python,
pointing the agent at an OpenAI-compatible ``base_url`` (a TITO session,
``.../sessions/{id}/v1``): Harbor's agent loop (``terminus-2`` by default: LiteLLM chat calls,
commands typed into a tmux session in the container) calls the session as it would call any
provider, so the session's samples hold the exact token ids and loss mask; the reward is
Harbor's verifier result. Trials run in a bridge process (`HarborBridge`, ``_harbor_bridge.py``,
JSON lines over stdio) that imports Harbor and LiteLLM once and runs trials concurrently.
`HarborAgent` is the same as an ``AgentFn`` for ``rollout.agent`` (the sample's ``label`` is
the task directory), one bridge for all its episodes::

    task:
      name: harbor
      params: {dir: ./my_tasks, max_turns: 8}
      reward_fn: "miles_env.rollout:episode_reward"
    rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.harbor:harbor_agent"}

What it takes on a machine without a registry (see packages/miles-env/README.md):

- podman + runc, rootful; Harbor's podman calls get a ``containers.conf`` (``runc``, the
  cgroupfs manager, ulimits within the host's hard limits) through ``$CONTAINERS_CONF``
  unless one is set already;
- a local base image: the task's Dockerfile ``FROM`` is replaced by
  `HarborTrialConfig.base_image` (default `AGENT_IMAGE`: ``miles-env podman-base``'s Debian
  plus tmux, which terminus-2 needs; `build_agent_image` makes it, apt reaching Debian once),
  and the container stops on SIGKILL (``STOPSIGNAL``: nothing in it handles SIGTERM);
- LiteLLM is kept from fetching its model price map from GitHub
  (``LITELLM_LOCAL_MODEL_COST_MAP``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from miles_env.backends.podman import BASE_IMAGE, build_image
from miles_env.integrations._bridge import JsonLinesBridge

__all__ = [
    "AGENT_IMAGE",
    "HarborAgent",
    "HarborBridge",
    "HarborError",
    "HarborTrialConfig",
    "build_agent_image",
    "harbor_agent",
    "harbor_python",
    "run_harbor_trial",
]

AGENT_IMAGE = "localhost/miles-env/harbor-agent:bookworm"
_CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:8192", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
# Sampling keys of the rollout's request that reach the agent's chat calls unchanged.
_CALL_KEYS = ("max_tokens", "top_p", "top_k", "min_p", "stop", "seed")
_BRIDGE = Path(__file__).with_name("_harbor_bridge.py")


def harbor_python(python: str | os.PathLike[str] | None = None) -> Path:
    """Harbor's own Python: ``python``, else ``$MILES_ENV_PYTHON_HARBOR``, else the one
    ``tools/setup_agent_frameworks.sh harbor`` installs.

    Raises:
        FileNotFoundError: none of them exists.
    """
    if python is None:
        python = os.environ.get("MILES_ENV_PYTHON_HARBOR")
    if python is None:
        cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
        python = cache / "frameworks" / "harbor" / "bin" / "python"
    path = Path(python)
    if not path.exists():
        raise FileNotFoundError(
            f"Harbor's Python {path} does not exist: run `bash tools/setup_agent_frameworks.sh "
            "harbor` or set $MILES_ENV_PYTHON_HARBOR"
        )
    return path


def build_agent_image(base: str = BASE_IMAGE, tag: str = AGENT_IMAGE) -> str:
    """``podman build`` ``tag``: ``base`` (``miles-env podman-base``) plus tmux, which Harbor's
    terminus agents drive; apt fetches it from Debian once. Returns the tag."""
    with tempfile.TemporaryDirectory() as ctx:
        df = Path(ctx) / "Dockerfile"
        df.write_text(
            f"FROM {base}\nRUN apt-get update && apt-get install -y --no-install-recommends "
            "tmux && rm -rf /var/lib/apt/lists/*\n"
        )
        return build_image(ctx, tag)


@dataclass(kw_only=True, slots=True)
class HarborTrialConfig:
    """How to run a Harbor trial.

    Attributes:
        agent: Harbor's agent name (``harbor trial start -a``) or ``module:Class``.
        environment: Harbor's environment type (``podman``: the one that runs here).
        model_name: the LiteLLM model name the agent asks for; ``openai/<name>`` sends
            OpenAI chat-completions requests to the base URL.
        max_turns: the agent's turn limit (Harbor's ``max_turns``; None: the agent's own).
        agent_timeout_s: overrides the task's ``[agent] timeout_sec`` (None: the task's).
        agent_kwargs: more keyword arguments of the agent (Harbor's ``agent.kwargs``).
        base_image: replaces the task Dockerfile's ``FROM`` (no registry is reachable) and
            adds ``STOPSIGNAL SIGKILL`` unless it has one; None builds the Dockerfile as it is.
        python: Harbor's Python (None: `harbor_python`).
        keep_trials_dir: keep Harbor's trial directory (logs, trajectory) instead of
            deleting it after the result is read.
        timeout_s: the whole trial (image build, agent, verifier).
    """

    agent: str = "terminus-2"
    environment: str = "podman"
    model_name: str = "openai/miles"
    max_turns: int | None = 8
    agent_timeout_s: float | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    base_image: str | None = AGENT_IMAGE
    python: str | None = None
    keep_trials_dir: bool = False
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.agent:
            raise ValueError("HarborTrialConfig.agent is empty: name a Harbor agent")
        if "/" not in self.model_name:
            raise ValueError(
                f"HarborTrialConfig.model_name {self.model_name!r} needs a LiteLLM provider "
                "prefix: use 'openai/<name>' for an OpenAI-compatible endpoint"
            )
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(
                f"HarborTrialConfig.max_turns must be >= 1 or None, got {self.max_turns}"
            )
        for name in ("agent_timeout_s", "timeout_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"HarborTrialConfig.{name} must be > 0, got {v}")


def _task_copy(task_dir: Path, base_image: str | None, into: Path) -> Path:
    """The task as Harbor will read it: a copy whose Dockerfile starts from ``base_image``."""
    for name in ("task.toml", "instruction.md"):
        if not (task_dir / name).is_file():
            raise FileNotFoundError(f"{task_dir} is not a Harbor task: it has no {name}")
    dst = into / task_dir.name
    shutil.copytree(task_dir, dst, symlinks=True)
    df = dst / "environment" / "Dockerfile"
    if base_image is not None and df.is_file():
        lines = df.read_text().splitlines()
        i = next((i for i, s in enumerate(lines) if s.strip().upper().startswith("FROM ")), None)
        if i is None:
            raise ValueError(f"{task_dir / 'environment' / 'Dockerfile'} has no FROM line")
        lines[i] = f"FROM {base_image}"
        if not any(s.strip().upper().startswith("STOPSIGNAL ") for s in lines):
            # Harbor's compose runs `sh -c "sleep infinity"` as PID 1, which ignores SIGTERM:
            # every trial's `down` waited out podman's 10 s grace period (measured) for nothing.
            lines.append("STOPSIGNAL SIGKILL")
        df.write_text("\n".join(lines) + "\n")
    return dst


def _bridge_env(python: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    # podman-compose lives next to Harbor's Python.
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    if "CONTAINERS_CONF" not in env:
        conf = work / "containers.conf"
        conf.write_text(_CONTAINERS_CONF)
        env["CONTAINERS_CONF"] = str(conf)
    env.setdefault("OPENAI_API_KEY", os.environ.get("MILES_API_KEY", "miles"))
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # read when LiteLLM is imported
    env["MILES_HARBOR_BRIDGE_DIR"] = str(work)
    return env


class HarborError(RuntimeError):
    """Harbor failed a trial before it had a result (the message is Harbor's), or the trial
    ran past its ``timeout_s`` (``TimeoutError: ...``)."""


class HarborBridge(JsonLinesBridge):
    """The bridge process in Harbor's Python (`_harbor_bridge.py`); trials run concurrently.

    It works in a folder of its own (its ``containers.conf`` and Harbor's log,
    ``bridge.log``), removed by `aclose`.

    Args:
        python: Harbor's Python (`harbor_python`).
    """

    def __init__(self, python: str | os.PathLike[str] | None = None) -> None:
        super().__init__(harbor_python(python), _BRIDGE, HarborError, "Harbor")
        self.work: Path | None = None

    async def start(self) -> None:
        """Start the process (once per event loop; again after it exited)."""
        if self._on_this_loop():
            assert self._proc is not None
            if self._proc.returncode is None:
                return
            await self.aclose()  # it died: the next trial gets a fresh one
        work = Path(tempfile.mkdtemp(prefix="miles-harbor-bridge-"))
        if await self._spawn(_bridge_env(Path(self.python), work)):
            self.work = work
            weakref.finalize(self, shutil.rmtree, work, True)
        else:  # another caller started it meanwhile
            shutil.rmtree(work, ignore_errors=True)

    async def trial(self, config: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        """Run one trial (Harbor's ``TrialConfig`` as JSON); Harbor's ``TrialResult``.

        Raises:
            HarborError: Harbor failed the trial, or it ran past ``timeout_s``.
        """
        await self.start()
        try:
            # The bridge cancels the trial at timeout_s; the margin covers Harbor's teardown.
            return dict(
                await asyncio.wait_for(
                    self._send("trial", config=dict(config), timeout_s=timeout_s),
                    timeout_s + 120,
                )
            )
        except (TimeoutError, asyncio.CancelledError):
            # Given up here: stop the trial there (Harbor stops its environment).
            with contextlib.suppress(Exception):
                cancel = self._send("cancel", name=str(config["trial_name"]))
                await asyncio.wait_for(asyncio.shield(cancel), 10)
            raise

    async def aclose(self) -> None:
        """End the process (it cancels the trials that still run) and remove its folder."""
        await super().aclose()
        work, self.work = self.work, None
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _reason(result: Mapping[str, Any], trial_dir: Path, reward: float) -> str:
    parts = [f"Harbor's verifier: reward {reward}"]
    out = trial_dir / "verifier" / "test-stdout.txt"
    if out.is_file():
        tail = out.read_text(errors="replace").strip()[-400:]
        parts.append(f"tests/test.sh said: {tail}" if tail else "tests/test.sh printed nothing")
    exc = result.get("exception_info")
    if exc:
        parts.append(f"the trial raised {exc['exception_type']}: {exc['exception_message']}")
    return "; ".join(parts)


async def run_harbor_trial(
    task_dir: str | os.PathLike[str],
    base_url: str,
    *,
    config: HarborTrialConfig | None = None,
    request: Mapping[str, Any] | None = None,
    bridge: HarborBridge | None = None,
) -> dict[str, Any]:
    """Run one Harbor trial of ``task_dir`` with Harbor's agent calling ``base_url``.

    Args:
        task_dir: a Harbor task directory.
        base_url: an OpenAI-compatible endpoint (a TITO session's ``.../v1``).
        config: how (None: `HarborTrialConfig` defaults).
        request: sampling settings for the agent's chat calls (``temperature`` becomes the
            agent's; ``max_tokens``, ``top_p``, ``top_k``, ``min_p``, ``stop``, ``seed`` go
            into each call).
        bridge: the bridge to run it in (None: one started and ended for this trial; its
            ``python`` wins over ``config.python``).

    Returns:
        ``reward`` (0.0 when the verifier gave none), ``scores`` (Harbor's rewards by name),
        ``verifier_error`` (why there is no reward, else None), ``reward_reason``,
        ``turns`` (the agent's episodes), ``result`` (Harbor's result.json) and
        ``trial_dir`` (None unless kept).

    Raises:
        FileNotFoundError: no Harbor Python, or ``task_dir`` is not a Harbor task.
        HarborError: Harbor failed the trial before it had a result, or it timed out.
    """
    cfg = config or HarborTrialConfig()
    own = bridge is None
    if bridge is None:
        bridge = HarborBridge(cfg.python)  # FileNotFoundError names the setup
    task = Path(task_dir).resolve()
    req = dict(request or {})
    work = Path(tempfile.mkdtemp(prefix="miles-harbor-"))
    try:
        local_task = _task_copy(task, cfg.base_image, work)
        kwargs: dict[str, Any] = {"api_base": base_url, **cfg.agent_kwargs}
        if cfg.agent.startswith("terminus"):
            kwargs.setdefault("record_terminal_session", False)  # no asciinema to install
            kwargs.setdefault("enable_summarize", False)  # a full context ends the episode
        if cfg.max_turns is not None:
            kwargs["max_turns"] = cfg.max_turns
        if req.get("temperature") is not None:
            kwargs["temperature"] = req["temperature"]
        call = {k: req[k] for k in _CALL_KEYS if req.get(k) is not None}
        if call:
            kwargs["llm_call_kwargs"] = {**kwargs.get("llm_call_kwargs", {}), **call}
        name = f"{task.name}__{uuid.uuid4().hex[:8]}"
        trial = {
            "task": {"path": str(local_task)},
            "trial_name": name,
            "trials_dir": str(work / "trials"),
            "agent": {
                "name" if ":" not in cfg.agent else "import_path": cfg.agent,
                "model_name": cfg.model_name,
                "override_timeout_sec": cfg.agent_timeout_s,
                "kwargs": kwargs,
            },
            "environment": {"type": cfg.environment},
        }
        result = await bridge.trial(trial, cfg.timeout_s)
        trial_dir = work / "trials" / name
        rewards = (result.get("verifier_result") or {}).get("rewards") or {}
        scores = {k: float(v) for k, v in rewards.items() if isinstance(v, int | float)}
        verifier_error = None
        if "reward" not in scores:
            exc = result.get("exception_info") or {}
            why = exc.get("exception_message") or "the verifier wrote no reward"
            verifier_error = f"{exc.get('exception_type', 'no reward')}: {why}"
        reward = scores.get("reward", 0.0)
        meta = ((result.get("agent_result") or {}).get("metadata")) or {}
        return {
            "reward": reward,
            "scores": scores,
            "verifier_error": verifier_error,
            "reward_reason": _reason(result, trial_dir, reward),
            "turns": int(meta.get("n_episodes", 0)),
            "result": result,
            "trial_dir": str(trial_dir) if cfg.keep_trials_dir else None,
        }
    finally:
        if own:
            await bridge.aclose()
        if not cfg.keep_trials_dir:
            shutil.rmtree(work, ignore_errors=True)


class HarborAgent:
    """An ``AgentFn`` (``async agent(base_url, sample, request) -> metadata``): one Harbor
    trial of the task directory ``sample.label`` with Harbor's agent calling ``base_url``.

    Args:
        config: the trial settings; ``sample.metadata["harbor"]`` overrides fields by name
            and ``metadata["max_turns"]`` the turn limit.

    Trials run in one `HarborBridge` per Harbor Python, started by the first and kept for the
    next (`aclose` ends them; so does the end of this process).
    """

    def __init__(self, config: HarborTrialConfig | None = None) -> None:
        self.config = config or HarborTrialConfig()
        self._bridges: dict[str, HarborBridge] = {}

    def _bridge(self, python: str | None) -> HarborBridge:
        path = str(harbor_python(python))
        if path not in self._bridges:
            self._bridges[path] = HarborBridge(path)
        return self._bridges[path]

    async def __call__(self, base_url: str, sample: Any, request: dict[str, Any]) -> dict[str, Any]:
        """Play one trial; the metadata: ``reward``, ``scores``, ``task``, ``stopped``,
        ``reward_reason``, ``verifier_error``, ``notes``, ``metrics``."""
        md = dict(getattr(sample, "metadata", None) or {})
        overrides = dict(md.get("harbor") or {})
        if md.get("max_turns") is not None:
            overrides["max_turns"] = int(md["max_turns"])
        cfg = replace(self.config, **overrides)
        bridge = self._bridge(cfg.python)
        out = await run_harbor_trial(
            sample.label, base_url, config=cfg, request=request, bridge=bridge
        )
        task = Path(sample.label).name
        scores = dict(out["scores"])
        scores.setdefault("reward", out["reward"])
        exc = out["result"].get("exception_info")
        return {
            "reward": out["reward"],
            "scores": scores,
            "stopped": exc["exception_type"] if exc else "done",
            "task": task,
            "reward_reason": out["reward_reason"],
            "verifier_error": out["verifier_error"],
            "notes": [f"Harbor trial dir: {out['trial_dir']}"] if out["trial_dir"] else [],
            "metrics": {
                "agentic/turns": float(out["turns"]),
                f"agentic/reward/{task}": float(out["reward"]),
            },
        }

    async def aclose(self) -> None:
        """End every bridge process (trials still running are cancelled)."""
        bridges, self._bridges = list(self._bridges.values()), {}
        for b in bridges:
            await b.aclose()


harbor_agent = HarborAgent()
"""The instance a recipe names (``rollout.agent: miles_env.integrations.harbor:harbor_agent``)."""
