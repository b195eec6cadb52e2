"""Run Harbor tasks, each in its own sandbox, and collect their rewards.

One task: make a sandbox from the task's environment (the local backend replays the
Dockerfile's WORKDIR / ENV / COPY, podman builds it), let an agent act (``"oracle"``: run
solution/solve.sh; ``"noop"``: nothing; or any async callable), upload tests/ to /tests, run
``bash /tests/test.sh`` and read /logs/verifier/reward.txt (or reward.json). Whatever goes
wrong (a file missing, the sandbox failing, the verifier crashing, hanging or writing no
reward) gives reward 0 with the reason and ``error=True``; the other tasks still run, and the
sandbox is always closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from miles_env.harbor.task import HarborTask, TaskError, find_tasks, load_task
from miles_env.sandbox import Sandbox, create_sandbox
from miles_env.spec import ExecResult, SandboxSpec

__all__ = [
    "POLICIES",
    "Agent",
    "TaskResult",
    "Verdict",
    "builtin_tasks_dir",
    "check_tasks",
    "open_task_sandbox",
    "run_task",
    "run_tasks",
    "verify",
]

Agent = Callable[[Sandbox, HarborTask], Awaitable[Any]]
Policy = Literal["oracle", "noop"]
POLICIES = ("oracle", "noop")
REWARD_TXT = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
# Extra lifetime of a task's sandbox beyond its agent and verifier timeouts (setup, uploads).
_TTL_MARGIN_S = 300.0


@dataclass(kw_only=True, slots=True)
class TaskResult:
    """The outcome of one task.

    Attributes:
        task: the task's name.
        reward: the verifier's reward; 0.0 when ``error``.
        reason: why this reward: the verifier's last words below 1.0, or what went wrong.
        error: the task could not be run to a reward (bad task directory, sandbox failure,
            verifier crashed, timed out or wrote no reward).
        path: the task directory.
        duration_s: wall-clock seconds for the whole task.
        agent_exit_code: exit code of the agent's command (oracle), if one ran.
        verifier_exit_code: exit code of tests/test.sh, if it ran.
        notes: Dockerfile instructions the backend skipped, and similar remarks.
    """

    task: str
    reward: float
    reason: str
    error: bool = False
    path: str = ""
    duration_s: float = 0.0
    agent_exit_code: int | None = None
    verifier_exit_code: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``task`` and ``reward`` first)."""
        return asdict(self)


def builtin_tasks_dir() -> Path:
    """The terminal-task suite shipped with miles-env."""
    return Path(str(resources.files("miles_env") / "tasks"))


async def oracle_agent(sb: Sandbox, task: HarborTask) -> ExecResult:
    """Upload solution/ to /solution and run ``bash /solution/solve.sh`` in the workdir."""
    assert task.solution is not None
    await sb.upload_dir(task.solution.parent, "/solution")
    return await sb.exec(["bash", "/solution/solve.sh"], timeout=task.agent_timeout_s)


async def run_task(
    task_dir: str | Path,
    *,
    policy: Policy | Agent = "oracle",
    backend: str = "local",
    backend_options: Mapping[str, Any] | None = None,
    podman_base: str | None = None,
) -> TaskResult:
    """Run one task in a fresh sandbox (see the module docstring). Never raises for a
    problem of the task: it is the result's reason.

    Args:
        task_dir: the task directory.
        policy: "oracle", "noop", or an async ``agent(sandbox, task)``.
        backend: the sandbox backend ("local" or "podman"; cloud backends take the image
            from the task's Dockerfile as ``spec.image`` and cannot build it).
        backend_options: passed to `create_sandbox`.
        podman_base: podman only: a local image to build the task's Dockerfile FROM.
    """
    start = time.monotonic()
    path = Path(task_dir)
    result = TaskResult(task=path.name, reward=0.0, reason="", path=str(path))
    try:
        task = load_task(path)
        result.task = task.name
        if policy == "oracle" and task.solution is None:
            raise TaskError("missing solution/solve.sh (needed by the oracle policy)")
        await _run(task, result, policy, backend, dict(backend_options or {}), podman_base)
    except TaskError as e:
        _fail(result, str(e))
    except Exception as e:  # a sandbox or backend failure: this task's reason
        _fail(result, f"{type(e).__name__}: {e}")
    result.duration_s = time.monotonic() - start
    return result


def _fail(result: TaskResult, reason: str) -> None:
    result.reward, result.reason, result.error = 0.0, reason, True


async def _run(
    task: HarborTask,
    result: TaskResult,
    policy: Policy | Agent,
    backend: str,
    options: dict[str, Any],
    podman_base: str | None,
) -> None:
    sb = await open_task_sandbox(
        task,
        backend=backend,
        backend_options=options,
        podman_base=podman_base,
        notes=result.notes,
    )
    async with sb:
        if policy == "oracle":
            r = await oracle_agent(sb, task)
            result.agent_exit_code = r.exit_code
            if r.timed_out:
                result.notes.append(f"solve.sh timed out after {task.agent_timeout_s:g} s")
        elif policy != "noop":
            if not callable(policy):
                raise ValueError(f"policy must be one of {POLICIES} or an agent, got {policy!r}")
            await policy(sb, task)
        verdict = await verify(sb, task)
    result.verifier_exit_code = verdict.exit_code
    result.reward, result.reason, result.error = verdict.reward, verdict.reason, verdict.error


@dataclass(kw_only=True, slots=True)
class Verdict:
    """What a task's verifier said.

    Attributes:
        reward: the reward (0.0 when ``error``).
        scores: every named score the verifier wrote (reward.json may hold several);
            ``scores["reward"] == reward``.
        reason: why this reward (the verifier's last words below 1.0), or what went wrong.
        error: the verifier crashed, hung, or wrote no or a malformed reward.
        exit_code: exit code of tests/test.sh (124: timed out).
        duration_s: seconds the verifier ran (upload included).
    """

    reward: float
    scores: dict[str, float]
    reason: str
    error: bool = False
    exit_code: int | None = None
    duration_s: float = 0.0


async def open_task_sandbox(
    task: HarborTask,
    *,
    backend: str = "local",
    backend_options: Mapping[str, Any] | None = None,
    podman_base: str | None = None,
    notes: list[str] | None = None,
) -> Sandbox:
    """A fresh sandbox set up as the task's environment, ready for an agent.

    The spec comes from task.toml; the local backend replays the Dockerfile's WORKDIR / ENV /
    COPY (what it skips is appended to ``notes``), podman builds the Dockerfile. /logs/verifier
    and /logs/agent exist. The caller closes the sandbox (``async with``).
    """
    env = {k: v for k, v in task.plan.env.items() if k.isidentifier()}
    spec = SandboxSpec(
        workdir=task.workdir,
        env=env,
        cpus=task.cpus,
        memory_mb=task.memory_mb,
        disk_mb=task.storage_mb,
        network="none",
        ttl_s=task.agent_timeout_s + task.verifier_timeout_s + _TTL_MARGIN_S,
    )
    replay = backend != "podman"
    if backend == "podman":
        spec = spec.replace(image=await _podman_image(task, podman_base))
    elif task.plan.ignored and notes is not None:
        notes += [f"{backend} backend skipped: {line}" for line in task.plan.ignored]
    sb = await create_sandbox(spec, backend=backend, **dict(backend_options or {}))
    try:
        if replay:
            await _replay_copies(sb, task)
        await sb.exec(["mkdir", "-p", "/logs/verifier", "/logs/agent"], cwd="/")
    except BaseException:
        await sb.close()
        raise
    return sb


async def _replay_copies(sb: Sandbox, task: HarborTask) -> None:
    context = task.path / "environment"
    for src, dest in task.plan.copies:
        local = context / src
        if local.is_dir():
            await sb.upload_dir(local, dest.rstrip("/") or "/")
        else:
            target = dest + local.name if dest.endswith("/") else dest
            await sb.write_file(target, local.read_bytes(), mode=local.stat().st_mode & 0o777)


async def verify(sb: Sandbox, task: HarborTask) -> Verdict:
    """Upload tests/ to /tests, run ``bash /tests/test.sh`` and read the reward it wrote.

    Never raises for the verifier's own failures (crash, hang, no or a malformed reward):
    they are the verdict's ``error`` and ``reason``.
    """
    t0 = time.monotonic()
    await sb.upload_dir(task.path / "tests", "/tests")
    r = await sb.exec(
        ["bash", "/tests/test.sh"], env=task.verifier_env, timeout=task.verifier_timeout_s
    )
    said = _tail(r.stdout + r.stderr)

    def failed(reason: str) -> Verdict:
        return Verdict(
            reward=0.0,
            scores={"reward": 0.0},
            reason=reason,
            error=True,
            exit_code=r.exit_code,
            duration_s=time.monotonic() - t0,
        )

    if r.timed_out:
        return failed(f"verifier timed out after {task.verifier_timeout_s:g} s; {said}")
    scores, source = await _read_reward(sb)
    if scores is None:
        return failed(
            f"verifier exited {r.exit_code} without writing {REWARD_TXT} or {REWARD_JSON}"
            + (f"; {source}" if source else "")
            + (f"; it said: {said}" if said else "")
        )
    reward = scores["reward"]
    reason = f"reward {reward:g} from {source}"
    if reward < 1.0 and said:
        reason += f"; verifier said: {said}"
    return Verdict(
        reward=reward,
        scores=scores,
        reason=reason,
        exit_code=r.exit_code,
        duration_s=time.monotonic() - t0,
    )


async def _read_reward(sb: Sandbox) -> tuple[dict[str, float] | None, str]:
    """(named scores with "reward", where they came from) or (None, what was wrong)."""
    try:
        text = (await sb.read_file(REWARD_TXT)).decode(errors="replace").strip()
    except FileNotFoundError:
        text = None
    if text is not None:
        try:
            value = float(text)
        except ValueError:
            return None, f"reward.txt holds {text[:60]!r}, not a number"
        if not math.isfinite(value):
            return None, "reward.txt not finite"
        return {"reward": value}, "reward.txt"
    try:
        raw = json.loads(await sb.read_file(REWARD_JSON))
    except FileNotFoundError:
        return None, ""
    except ValueError as e:
        return None, f"reward.json is not JSON: {e}"
    if _is_number(raw):
        return {"reward": float(raw)}, "reward.json"
    if isinstance(raw, dict):
        scores = {str(k): float(v) for k, v in raw.items() if _is_number(v)}
        if not all(math.isfinite(v) for v in scores.values()):
            return None, "reward.json holds a non-finite score"
        if "reward" in scores:
            return scores, "reward.json"
        if len(raw) == 1 and len(scores) == 1:
            return {"reward": next(iter(scores.values())), **scores}, "reward.json"
    return None, "reward.json has no numeric 'reward' key"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tail(text: str, lines: int = 3, chars: int = 300) -> str:
    """The last few non-empty lines of a verifier's output, one line, at most ``chars``."""
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    joined = " | ".join(kept)
    return joined if len(joined) <= chars else joined[: chars - 3] + "..."


async def _podman_image(task: HarborTask, base: str | None) -> str:
    from miles_env.backends.podman import BASE_IMAGE, build_image

    if task.dockerfile is None:
        return base or BASE_IMAGE
    digest = hashlib.sha256()
    for p in sorted((task.path / "environment").rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(task.path)).encode() + p.read_bytes())
    digest.update((base or "").encode())
    tag = f"localhost/miles-env-task/{task.path.name.lower()}:{digest.hexdigest()[:12]}"
    return await asyncio.to_thread(
        build_image, task.path / "environment", tag, dockerfile=task.dockerfile, base=base
    )


async def run_tasks(
    task_dirs: Sequence[str | Path],
    *,
    policy: Policy | Agent = "oracle",
    backend: str = "local",
    concurrency: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    podman_base: str | None = None,
    on_result: Callable[[TaskResult], None] | None = None,
) -> list[TaskResult]:
    """Run several tasks, ``concurrency`` at a time (default: the CPU count, at most 4),
    each in its own sandbox. Results come back in the order of ``task_dirs``;
    ``on_result`` sees each one as it finishes."""
    limit = asyncio.Semaphore(concurrency or min(4, os.cpu_count() or 1))

    async def one(d: str | Path) -> TaskResult:
        async with limit:
            r = await run_task(
                d,
                policy=policy,
                backend=backend,
                backend_options=backend_options,
                podman_base=podman_base,
            )
        if on_result is not None:
            on_result(r)
        return r

    return list(await asyncio.gather(*(one(d) for d in task_dirs)))


def check_tasks(
    dir: str | Path | None = None,
    policy: Policy = "oracle",
    *,
    backend: str = "local",
    concurrency: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    podman_base: str | None = None,
    on_result: Callable[[TaskResult], None] | None = None,
) -> list[TaskResult]:
    """Run every Harbor task under ``dir`` (None: the built-in suite) and return one
    `TaskResult` per task, with its reward and reason.

    Args:
        dir: a task directory, or a directory of task directories.
        policy: "oracle" (run each task's solution/solve.sh) or "noop" (do nothing).
        backend: "local" (default) or "podman".
        concurrency: tasks at a time.
        backend_options: passed to `create_sandbox`.
        podman_base: podman only: a local image to build each Dockerfile FROM.
        on_result: called with each result as it finishes.

    Raises:
        FileNotFoundError: ``dir`` does not exist.
        ValueError: an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    tasks = find_tasks(builtin_tasks_dir() if dir is None else dir)
    return asyncio.run(
        run_tasks(
            tasks,
            policy=policy,
            backend=backend,
            concurrency=concurrency,
            backend_options=backend_options,
            podman_base=podman_base,
            on_result=on_result,
        )
    )
