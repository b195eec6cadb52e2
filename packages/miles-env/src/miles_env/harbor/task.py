"""A Harbor task directory, read and checked.

Layout (Harbor / Terminal-Bench)::

    task-name/
      task.toml            version, [metadata], [verifier] timeout_sec / env,
                           [agent] timeout_sec, [environment] cpus / memory_mb / storage_mb
      instruction.md       the prompt the agent gets
      environment/         Dockerfile and its build context
      tests/test.sh        the verifier: run after the agent, writes the reward to
                           /logs/verifier/reward.txt (a number) or reward.json
      solution/solve.sh    the reference (oracle) solution, optional
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from miles_env.harbor.dockerfile import DockerfilePlan, parse_dockerfile

__all__ = ["DEFAULT_WORKDIR", "HarborTask", "TaskError", "find_tasks", "load_task"]

DEFAULT_WORKDIR = "/app"
REQUIRED = ("task.toml", "instruction.md", "tests/test.sh")


class TaskError(ValueError):
    """The task directory cannot be run (a file missing, task.toml invalid, ...)."""


@dataclass(kw_only=True, slots=True)
class HarborTask:
    """One task, as read from its directory."""

    name: str
    path: Path
    instruction: str
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    dockerfile: Path | None = None
    plan: DockerfilePlan = field(default_factory=DockerfilePlan)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def workdir(self) -> str:
        """Where the agent starts and the verifier runs (the Dockerfile's WORKDIR)."""
        return self.plan.workdir or DEFAULT_WORKDIR

    @property
    def solution(self) -> Path | None:
        """solution/solve.sh, if the task has one."""
        p = self.path / "solution" / "solve.sh"
        return p if p.is_file() else None


def load_task(path: str | Path) -> HarborTask:
    """Read a task directory.

    Raises:
        TaskError: a required file is missing or task.toml / the Dockerfile is invalid; the
            message names the file.
    """
    root = Path(path)
    if not root.is_dir():
        raise TaskError(f"{root} is not a directory")
    missing = [f for f in REQUIRED if not (root / f).is_file()]
    if missing:
        raise TaskError(f"missing {', '.join(missing)} (a Harbor task needs {', '.join(REQUIRED)})")
    try:
        cfg = tomllib.loads((root / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"task.toml: {e}") from e
    agent = cfg.get("agent", {})
    verifier = cfg.get("verifier", {})
    environment = cfg.get("environment", {})
    task_meta = cfg.get("task", {})
    dockerfile = root / "environment" / "Dockerfile"
    plan = DockerfilePlan()
    if dockerfile.is_file():
        try:
            plan = parse_dockerfile(dockerfile)
        except ValueError as e:
            raise TaskError(str(e)) from e
        for src, _dest in plan.copies:
            if not (root / "environment" / src).exists():
                raise TaskError(f"environment/Dockerfile copies {src}, which does not exist")
    try:
        return HarborTask(
            name=str(task_meta.get("name") or root.name),
            path=root,
            instruction=(root / "instruction.md").read_text(),
            agent_timeout_s=float(agent.get("timeout_sec", 600.0)),
            verifier_timeout_s=float(verifier.get("timeout_sec", 600.0)),
            verifier_env={str(k): str(v) for k, v in verifier.get("env", {}).items()},
            cpus=float(environment.get("cpus", 1.0)),
            memory_mb=int(environment.get("memory_mb", 2048)),
            storage_mb=int(environment.get("storage_mb", 10240)),
            dockerfile=dockerfile if dockerfile.is_file() else None,
            plan=plan,
            metadata=dict(cfg.get("metadata", {})),
        )
    except (TypeError, ValueError, AttributeError) as e:
        raise TaskError(f"task.toml: {e}") from e


def find_tasks(root: str | Path) -> list[Path]:
    """Task directories under ``root``: ``root`` itself if it holds a task.toml or an
    instruction.md, else every directory directly inside it (hidden ones and __pycache__
    left out), sorted. A directory that is not a complete task is listed too, so that running
    it reports what it lacks instead of skipping it silently."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"{base}: no such directory")
    if (base / "task.toml").exists() or (base / "instruction.md").exists():
        return [base]
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
