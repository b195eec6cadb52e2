"""A HUD taskset as a ``Task`` of the loop: each prompt is one episode of one HUD task row.

    task:
      name: hud
      params: {source: ./env.py, max_turns: 4}      # the rows env.py declares
      reward_fn: "miles_env.rollout:episode_reward"
    rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.hud:hud_agent"}

A HUD task row is a template of a HUD environment with its arguments (``hud.eval.Task``: what
calling an ``@env.template`` returns; ``slug`` names it). The rows are listed once, at
start-up, by miles-env's bridge in HUD's own Python (``tools/setup_agent_frameworks.sh hud``)
with HUD's ``Taskset.from_file``: the module-level rows of ``source`` (``tasks =
[add(a=2, b=3), ...]``) or of ``taskset`` (a ``.py`` file or folder, or JSON / JSONL rows as
``Taskset.to_file`` writes them). ``sample(n)`` walks them in a seeded order (a fresh shuffle
every pass); each ``PromptItem`` has the template id as ``label`` and, in ``metadata["hud"]``,
the environment and arguments ``hud_agent`` plays. HUD's own agent loop plays the episode
through the sample's TITO session and HUD's grade is the reward (``metadata["reward"]``, read
by ``episode_reward``).

The item's ``messages`` only describe the row: the prompt the model sees is what the template
yields when HUD starts it inside the episode (starting it here would run its setup code), and
the trained tokens are the session's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.integrations.hud import HudError, list_hud_tasks
from miles_rollout.types import PromptItem

__all__ = ["HudTaskSet"]

_RUNTIMES = ("local", "subprocess")


@dataclass(kw_only=True, slots=True)
class HudTaskSet:
    """Prompts from the task rows of a HUD environment (see the module docstring).

    Attributes:
        source: the HUD environment: a ``.py`` file, a folder of them (relative: to the
            working directory), or an importable module.
        env: the environment's name, when the source declares several.
        taskset: where the task rows are: a ``.py`` file or folder declaring
            ``hud.eval.Task`` rows, or a JSON / JSONL file of rows; ``None``: ``source``.
        tasks: slugs of the rows to use (``None``: all of them).
        python: HUD's Python (``None``: ``$MILES_ENV_PYTHON_HUD`` or the one
            ``tools/setup_agent_frameworks.sh hud`` installs).
        runtime: how HUD serves the environment per episode: ``"local"`` (in the bridge)
            or ``"subprocess"`` (a child process per episode).
        system_prompt: the system prompt of HUD's agent (``None``: HUD's default).
        max_turns: HUD's step limit per episode.
        seed: seed of the order in which rows are drawn.
    """

    source: str
    env: str | None = None
    taskset: str | None = None
    tasks: list[str] | None = None
    python: str | None = None
    runtime: str = "local"
    system_prompt: str | None = None
    max_turns: int = 8
    seed: int = 0
    _rows: list[dict[str, Any]] = field(init=False, repr=False)
    _templates: dict[str, str] = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _order: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError(
                "task.params.source must name a HUD environment (a .py file, a folder or a module)"
            )
        if self.max_turns < 1:
            raise ValueError(f"task.params.max_turns must be >= 1, got {self.max_turns}")
        if self.runtime not in _RUNTIMES:
            raise ValueError(
                f"task.params.runtime must be one of {list(_RUNTIMES)}, got {self.runtime!r}"
            )
        self.source = _absolute(self.source)
        if self.taskset is not None:
            self.taskset = str(Path(self.taskset).expanduser().resolve())
        try:
            listed = list_hud_tasks(
                self.source, env=self.env, taskset=self.taskset, python=self.python
            )
        except FileNotFoundError as e:  # no HUD Python: the message names the setup
            raise ValueError(f"task hud: {e}") from e
        except HudError as e:
            where = "task.params.taskset" if self.taskset else "task.params.source"
            raise ValueError(f"{where}: HUD could not load its tasks: {e}") from e
        self.env = str(listed["name"])
        self._templates = dict(listed["templates"])
        rows = select_rows(listed["rows"], self.tasks, where=self.taskset or self.source)
        for row in rows:
            if row["env"] != self.env or row["id"] not in self._templates:
                raise ValueError(
                    f"HUD task {row['slug']!r} is template {row['id']!r} of environment "
                    f"{row['env']!r}, but task.params.source serves environment {self.env!r} "
                    f"with templates {', '.join(self._templates) or 'none'}"
                )
        self._rows = rows
        self._rng = random.Random(self.seed)
        self._order = []

    @property
    def names(self) -> list[str]:
        """The rows' slugs, in the taskset's order."""
        return [r["slug"] for r in self._rows]

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` episodes' prompts."""
        return [self._item(self._next()) for _ in range(n)]

    def _next(self) -> dict[str, Any]:
        if not self._order:
            self._order = list(range(len(self._rows)))
            self._rng.shuffle(self._order)
        return self._rows[self._order.pop()]

    def _item(self, row: dict[str, Any]) -> PromptItem:
        spec = {
            "source": self.source,
            "env": self.env,
            "args": dict(row["args"]),
            "python": self.python,
            "runtime": self.runtime,
            "system_prompt": self.system_prompt,
        }
        what = f"HUD task {row['slug']}: template {row['id']!r}, args {row['args']}"
        if self._templates.get(row["id"]):
            what += f" ({self._templates[row['id']]})"
        messages = [{"role": "user", "content": what}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        meta = {"task": row["slug"], "hud": spec, "max_turns": self.max_turns}
        return PromptItem(messages=messages, label=row["id"], metadata=meta)

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """Not used: an episode's reward is HUD's grade.

        Raises:
            ValueError: always, naming the reward function to set.
        """
        raise ValueError(
            f"the reward of HUD template {label!r} is HUD's grade inside the episode: "
            "set task.reward_fn: miles_env.rollout:episode_reward (and rollout.generate_fn: "
            "multi_turn with rollout.agent: miles_env.integrations.hud:hud_agent)"
        )


def select_rows(
    rows: list[dict[str, Any]], slugs: list[str] | None, *, where: str
) -> list[dict[str, Any]]:
    """The rows named by ``slugs`` in that order (``None``: all of them).

    Raises:
        ValueError: a slug no row has (the message lists the slugs there are), or no rows.
    """
    if slugs is not None:
        by_slug = {r["slug"]: r for r in rows}
        unknown = [s for s in slugs if s not in by_slug]
        if unknown:
            raise ValueError(
                f"task.params.tasks: {where} has no HUD task {', '.join(map(repr, unknown))}; "
                f"it has: {', '.join(sorted(by_slug)) or 'none'}"
            )
        rows = [by_slug[s] for s in slugs]
    if not rows:
        raise ValueError(
            f"{where} declares no HUD task rows: add some at module level (e.g. "
            "`tasks = [add(a=2, b=3)]`, calls of its templates) or set task.params.taskset to "
            "a file of rows (a .py file, or JSON / JSONL as hud.eval.Taskset.to_file writes)"
        )
    return rows


def _absolute(source: str) -> str:
    """A source path made absolute (HUD's bridge runs elsewhere); a module name as is."""
    path = Path(source).expanduser()
    if path.exists() or path.suffix == ".py":
        return str(path.resolve())
    return source
