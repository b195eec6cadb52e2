"""A Prime Intellect Verifiers taskset as a ``Task`` of the loop: each prompt is one episode.

    task:
      name: verifiers
      params: {taskset: my_taskset, pythonpath: [./envs], max_turns: 8}
      reward_fn: "miles_env.rollout:episode_reward"
    rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.verifiers:verifiers_agent"}

The tasks are listed once, at start-up, by miles-env's bridge in Verifiers' own Python
(``tools/setup_agent_frameworks.sh verifiers``). ``sample(n)`` walks them in a seeded order (a
fresh shuffle every pass); each ``PromptItem`` holds the task's prompt messages (what
Verifiers' chat program sends first), the task's ``id`` (or ``idx``) as ``label`` and, in
``metadata["verifiers"]``, the taskset the agent loads. Verifiers' own loop plays the episode
through the sample's TITO session and its rubric gives the reward (``metadata["reward"]``,
read by ``episode_reward``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.integrations.verifiers import list_verifiers_tasks
from miles_rollout.types import PromptItem

__all__ = ["VerifiersTaskSet"]


@dataclass(kw_only=True, slots=True)
class VerifiersTaskSet:
    """Prompts from a Verifiers taskset (see the module docstring).

    Attributes:
        taskset: the taskset id (an importable module exporting its ``Taskset``).
        config: fields of the taskset's config.
        pythonpath: folders the taskset is imported from (relative: to the working directory).
        python: Verifiers' Python (``None``: ``$MILES_ENV_PYTHON_VERIFIERS`` or the one
            ``tools/setup_agent_frameworks.sh verifiers`` installs).
        tasks: ids of the tasks to use (``None``: all of them).
        max_turns: Verifiers' turn limit per episode.
        seed: seed of the order in which tasks are drawn.
    """

    taskset: str
    config: dict[str, Any] = field(default_factory=dict)
    pythonpath: list[str] = field(default_factory=list)
    python: str | None = None
    tasks: list[str] | None = None
    max_turns: int = 8
    seed: int = 0
    _tasks: list[dict[str, Any]] = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _order: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.taskset:
            raise ValueError("task.params.taskset must name a Verifiers taskset module")
        if self.max_turns < 1:
            raise ValueError(f"task.params.max_turns must be >= 1, got {self.max_turns}")
        self.pythonpath = [str(Path(p).expanduser().resolve()) for p in self.pythonpath]
        try:
            found = list_verifiers_tasks(
                self.taskset, config=self.config, python=self.python, pythonpath=self.pythonpath
            )
        except FileNotFoundError as e:  # no Verifiers Python: the message names the setup
            raise ValueError(f"task verifiers: {e}") from e
        if self.tasks is not None:
            by_id = {str(t["id"]): t for t in found if t["id"] is not None}
            unknown = [t for t in self.tasks if t not in by_id]
            if unknown:
                raise ValueError(
                    f"task.params.tasks: taskset {self.taskset!r} has no task "
                    f"{', '.join(map(repr, unknown))}; it has: {', '.join(sorted(by_id))}"
                )
            found = [by_id[t] for t in self.tasks]
        if not found:
            raise ValueError(f"Verifiers taskset {self.taskset!r} has no tasks")
        self._tasks = found
        self._rng = random.Random(self.seed)
        self._order = []

    @property
    def names(self) -> list[str]:
        """The tasks' ids (or names, or ``task-<idx>``), in the taskset's order."""
        return [_name(t) for t in self._tasks]

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` episodes' prompts."""
        return [self._item(self._next()) for _ in range(n)]

    def _next(self) -> dict[str, Any]:
        if not self._order:
            self._order = list(range(len(self._tasks)))
            self._rng.shuffle(self._order)
        return self._tasks[self._order.pop()]

    def _item(self, task: dict[str, Any]) -> PromptItem:
        spec = {
            "taskset": self.taskset,
            "config": self.config,
            "pythonpath": self.pythonpath,
            "python": self.python,
        }
        meta = {"task": _name(task), "verifiers": spec, "max_turns": self.max_turns}
        label = task["id"] if task["id"] is not None else task["idx"]
        messages = task["messages"] or [{"role": "user", "content": ""}]
        return PromptItem(messages=messages, label=label, metadata=meta)

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """Not used: an episode's reward comes from the task's rubric.

        Raises:
            ValueError: always, naming the reward function to set.
        """
        raise ValueError(
            f"the reward of Verifiers task {label!r} comes from its rubric inside the episode: "
            "set task.reward_fn: miles_env.rollout:episode_reward (and rollout.generate_fn: "
            "multi_turn with rollout.agent: miles_env.integrations.verifiers:verifiers_agent)"
        )


def _name(task: dict[str, Any]) -> str:
    return str(task["id"] or task["name"] or f"task-{task['idx']}")
