"""NeMo Gym task rows as a ``Task`` of the loop: each prompt is one episode of one row.

    task:
      name: nemo_gym
      params:
        data: ./example.jsonl                               # NeMo Gym's JSONL rows
        resources_server: "resources_servers/my_env/app.py:MyServer"   # or resources_url
        max_turns: 8
      reward_fn: "miles_env.rollout:episode_reward"
    rollout: {generate_fn: multi_turn, agent: "miles_env.integrations.nemo_gym:nemo_gym_agent"}

A row is what NeMo Gym's rollout collection reads from its input JSONL: an object with
``responses_create_params`` (the Responses API request: ``input``, ``tools``, ...) plus the
fields its resources server's ``/verify`` reads (the expected answer, ...). The rows are read
once, at start-up, from ``data`` (a JSONL file) and/or ``rows`` (inline). ``sample(n)`` walks
them in a seeded order (a fresh shuffle every pass); each ``PromptItem`` holds the row's
``input`` as chat messages, the row's ``id`` (or its index) as ``label`` and, in
``metadata["nemo_gym"]``, the row and the resources server ``nemo_gym_agent`` plays it on:
NeMo Gym's own ``simple_agent`` in NeMo Gym's Python (``tools/setup_agent_frameworks.sh
nemo-gym``) calls the sample's TITO session as its model, and ``/verify``'s reward is the
sample's (``metadata["reward"]``, read by ``episode_reward``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.integrations.nemo_gym import chat_messages, nemo_gym_python
from miles_rollout.types import PromptItem

__all__ = ["NemoGymTaskSet"]


@dataclass(kw_only=True, slots=True)
class NemoGymTaskSet:
    """Prompts from NeMo Gym task rows (see the module docstring).

    Attributes:
        data: a JSONL file of rows, one JSON object a line (relative: to the working
            directory), as NeMo Gym's rollout collection reads them.
        rows: rows given inline (after those of ``data``).
        resources_server: the resources server (a ``SimpleResourcesServer`` subclass) that
            NeMo Gym's Python serves for the run: ``"file.py:Class"`` (relative: to the working
            directory) or ``"module:Class"`` (NeMo Gym's shipped ones:
            ``"resources_servers.<name>.app:<Class>"``).
        resources_url: or the base URL of a resources server that is already running.
        resources_config: the resources server's config fields (with ``resources_server``).
        tasks: ids of the rows to use, in that order (``None``: all of them).
        python: NeMo Gym's Python (``None``: ``$MILES_ENV_PYTHON_NEMO_GYM`` or the one
            ``tools/setup_agent_frameworks.sh nemo-gym`` installs).
        max_turns: the model calls NeMo Gym's agent may make per episode (its ``max_steps``).
        seed: seed of the order in which rows are drawn.
    """

    data: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    resources_server: str | None = None
    resources_url: str | None = None
    resources_config: dict[str, Any] = field(default_factory=dict)
    tasks: list[str] | None = None
    python: str | None = None
    max_turns: int = 8
    seed: int = 0
    _rows: list[tuple[str, dict[str, Any]]] = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _order: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"task.params.max_turns must be >= 1, got {self.max_turns}")
        self._check_resources()
        try:
            self.python = str(nemo_gym_python(self.python))
        except FileNotFoundError as e:  # no NeMo Gym Python: the message names the setup
            raise ValueError(f"task nemo_gym: {e}") from e
        rows = read_rows(self.data) if self.data is not None else []
        if not isinstance(self.rows, list):
            raise ValueError("task.params.rows must be a list of NeMo Gym task rows (objects)")
        for i, row in enumerate(self.rows):
            _check_row(row, f"task.params.rows[{i}]")
            rows.append(row)
        if not rows:
            raise ValueError(
                "task nemo_gym needs task rows: set task.params.data to a JSONL file of NeMo "
                'Gym rows (one {"responses_create_params": {"input": ...}, ...} a line) '
                "or task.params.rows to a list of them"
            )
        named = [(_name(row, i), row) for i, row in enumerate(rows)]
        if self.tasks is not None:
            by_id = dict(named)
            unknown = [t for t in self.tasks if t not in by_id]
            if unknown:
                raise ValueError(
                    f"task.params.tasks: no NeMo Gym row has id {', '.join(map(repr, unknown))}; "
                    f"the ids are: {', '.join(sorted(by_id))}"
                )
            named = [(t, by_id[t]) for t in self.tasks]
        self._rows = named
        self._rng = random.Random(self.seed)
        self._order = []

    def _check_resources(self) -> None:
        if bool(self.resources_server) == bool(self.resources_url):
            raise ValueError(
                "task nemo_gym needs one resources server: task.params.resources_server: "
                "'file.py:Class' or 'module:Class' (served in NeMo Gym's Python), or "
                "task.params.resources_url: 'http://host:port' (one already running)"
            )
        if self.resources_url:
            if not self.resources_url.startswith(("http://", "https://")):
                raise ValueError(
                    "task.params.resources_url must be a resources server's base URL "
                    f"('http://host:port'), got {self.resources_url!r}"
                )
            return
        where, sep, attr = str(self.resources_server).rpartition(":")
        if not sep or not where or not attr:
            raise ValueError(
                "task.params.resources_server must be 'file.py:Class' or 'module:Class', got "
                f"{self.resources_server!r}"
            )
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ValueError(
                    f"task.params.resources_server: {path} does not exist (a .py file is read "
                    f"relative to the working directory, {Path.cwd()})"
                )
            self.resources_server = f"{path.resolve()}:{attr}"  # the bridge runs elsewhere

    @property
    def names(self) -> list[str]:
        """The rows' ids (``row-<i>`` for a row without one), in the rows' order."""
        return [name for name, _ in self._rows]

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` episodes' prompts."""
        return [self._item(self._next()) for _ in range(n)]

    def _next(self) -> tuple[str, dict[str, Any]]:
        if not self._order:
            self._order = list(range(len(self._rows)))
            self._rng.shuffle(self._order)
        return self._rows[self._order.pop()]

    def _item(self, named: tuple[str, dict[str, Any]]) -> PromptItem:
        name, row = named
        spec = {
            "row": row,
            "resources_server": self.resources_server,
            "resources_url": self.resources_url,
            "resources_config": self.resources_config,
            "python": self.python,
        }
        meta = {"task": name, "nemo_gym": spec, "max_turns": self.max_turns}
        messages = chat_messages(row["responses_create_params"]["input"])
        return PromptItem(
            messages=messages or [{"role": "user", "content": ""}],
            label=name,
            metadata=meta,
        )

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """Not used: an episode's reward is the resources server's ``/verify``.

        Raises:
            ValueError: always, naming the reward function to set.
        """
        raise ValueError(
            f"the reward of NeMo Gym row {label!r} is /verify's inside the episode: set "
            "task.reward_fn: miles_env.rollout:episode_reward (and rollout.generate_fn: "
            "multi_turn with rollout.agent: miles_env.integrations.nemo_gym:nemo_gym_agent)"
        )


def read_rows(data: str) -> list[dict[str, Any]]:
    """The rows of a JSONL file (blank lines skipped).

    Raises:
        ValueError: no such file, or a line that is not a JSON object with
            ``responses_create_params.input`` (the message names the file and line).
    """
    path = Path(data).expanduser()
    if not path.is_file():
        raise ValueError(
            f"task.params.data: {path} does not exist (a JSONL file of NeMo Gym task rows, "
            f"relative to the working directory, {Path.cwd()})"
        )
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"task.params.data: {where}: not JSON ({e.msg})") from e
        _check_row(row, where)
        rows.append(row)
    return rows


def _check_row(row: Any, where: str) -> None:
    params = row.get("responses_create_params") if isinstance(row, Mapping) else None
    if not isinstance(params, Mapping) or "input" not in params:
        got = f"keys {sorted(row)}" if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(
            f"{where}: a NeMo Gym task row needs responses_create_params with an input "
            '({"responses_create_params": {"input": [...], "tools": [...]}, ...}); '
            f"got {got}"
        )


def _name(row: Mapping[str, Any], i: int) -> str:
    return str(row["id"]) if row.get("id") is not None else f"row-{i}"
