"""Harbor task directories as a ``Task`` of the loop: each prompt is one episode of one task.

    task: {name: harbor, params: {toolset: coding, max_turns: 12, tasks: [python-bug]}}

``sample(n)`` walks the tasks in a seeded order (a fresh shuffle every pass); each
``PromptItem`` holds the episode's opening messages, the task directory as ``label`` and what
the episode agent (``miles_env.rollout:terminal_agent``) needs in ``metadata`` (``task``,
``env``, ``max_turns``). The reward comes from the task's verifier inside the episode, so
recipes set ``task.reward_fn: miles_env.rollout:episode_reward``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.environment import TerminalEnvConfig
from miles_env.environment.terminal import initial_messages
from miles_env.harbor import HarborTask, TaskError, builtin_tasks_dir, find_tasks, load_task
from miles_rollout.types import PromptItem

__all__ = ["HarborTaskSet"]


@dataclass(kw_only=True, slots=True)
class HarborTaskSet:
    """Prompts from Harbor task directories (see the module docstring).

    Attributes:
        dir: a directory of task directories, or one task; ``None``: miles-env's built-in
            terminal suite.
        tasks: names of the task directories to use (``None``: all of them).
        toolset: ``"bash"`` (terminal tasks) or ``"coding"`` (bash plus file tools).
        max_turns: the most assistant replies per episode.
        env: further `miles_env.environment.TerminalEnvConfig` fields (``backend``,
            ``command_timeout_s``, ``max_output_chars``, ``system_prompt``, ...).
        seed: seed of the order in which tasks are drawn.
    """

    dir: str | None = None
    tasks: list[str] | None = None
    toolset: str = "bash"
    max_turns: int = 16
    env: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    _paths: list[Path] = field(init=False, repr=False)
    _config: TerminalEnvConfig = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _order: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"task.params.max_turns must be >= 1, got {self.max_turns}")
        self._config = TerminalEnvConfig.coerce({**self.env, "toolset": self.toolset})
        root = Path(self.dir).expanduser() if self.dir else builtin_tasks_dir()
        paths = find_tasks(root)  # FileNotFoundError names a missing dir
        if self.tasks is not None:
            by_name = {p.name: p for p in paths}
            unknown = [t for t in self.tasks if t not in by_name]
            if unknown:
                raise ValueError(
                    f"task.params.tasks: no task {', '.join(map(repr, unknown))} under {root}; "
                    f"there are: {', '.join(sorted(by_name))}"
                )
            paths = [by_name[t] for t in self.tasks]
        if not paths:
            raise ValueError(f"no Harbor task directories under {root}")
        self._paths = paths
        self._rng = random.Random(self.seed)
        self._order = []

    @property
    def paths(self) -> list[Path]:
        """The task directories prompts are drawn from."""
        return list(self._paths)

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` episodes' prompts."""
        return [self._item(self._next()) for _ in range(n)]

    def _next(self) -> Path:
        if not self._order:
            self._order = list(range(len(self._paths)))
            self._rng.shuffle(self._order)
        return self._paths[self._order.pop()]

    def _item(self, path: Path) -> PromptItem:
        env = {k: getattr(self._config, k) for k in self._config.__dataclass_fields__}
        meta: dict[str, Any] = {"task": path.name, "env": env, "max_turns": self.max_turns}
        try:
            task: HarborTask | None = load_task(path)
        except TaskError as e:
            # A broken task fails its own episodes (the agent reports why), not the run.
            task, meta["task_error"] = None, str(e)
        messages = (
            initial_messages(task, self._config)
            if task is not None
            else [{"role": "user", "content": f"(task {path.name} cannot be loaded)"}]
        )
        return PromptItem(messages=messages, label=str(path), metadata=meta)

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """Not used: an episode's reward comes from its verifier.

        Raises:
            ValueError: always, naming the reward function to set.
        """
        raise ValueError(
            f"the reward of Harbor task {label} comes from its verifier inside the episode: "
            "set task.reward_fn: miles_env.rollout:episode_reward (and rollout.generate_fn: "
            "multi_turn with rollout.agent: miles_env.rollout:terminal_agent)"
        )
