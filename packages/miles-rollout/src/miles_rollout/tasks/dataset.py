"""Prompts from data users have: JSONL, JSON, Parquet and local Hugging Face ``datasets`` dirs.

    task:
      name: dataset
      params: {path: data/gsm8k.jsonl, template: "{question}", label_field: answer}
    # or prompt_field: messages (a chat list) / prompt (a string); split, shuffle, seed

Every row is read and checked when the task is built, so a bad row (not JSON, not an object,
a missing field, an empty prompt) is a ``ValueError`` at start naming the file and the row,
never a failure halfway through a run. Rows are served in a seeded random order, reshuffled
each epoch. The reward is graded by ``task.reward_fn`` (e.g. ``miles.rewards:math_equivalence``)
or, without one, by this task's exact match of the response against the label.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_rollout.types import PromptItem

__all__ = ["DatasetTask", "read_rows"]

_SUFFIXES = (".jsonl", ".json", ".parquet")


def _missing(dep: str, what: str) -> ImportError:
    return ImportError(f"reading {what} needs {dep}: pip install {dep} (or 'miles-rollout[data]')")


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:line {line_no}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} is not valid JSON ({e.msg})") from None


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); JSON Lines files end in .jsonl"
        ) from None
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of row objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"{path}:row {i}", row


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise _missing("pyarrow", "Parquet files") from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise ValueError(f"{path} is not a readable Parquet file: {e}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def _hf_dir(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise _missing("datasets", "a Hugging Face datasets directory") from e
    ds = datasets.load_from_disk(str(path))
    where = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(
                    f"{path} holds the splits {sorted(ds)}; choose one with task.params.split"
                )
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"{path} has no split {split!r}; its splits: {sorted(ds)}")
        ds, where = ds[split], f"{path}[{split}]"
    elif split is not None:
        raise ValueError(f"{path} is a single dataset without splits; drop task.params.split")
    for i, row in enumerate(ds):
        yield f"{where}:row {i}", row


def read_rows(path: str | Path, *, split: str | None = None) -> list[tuple[str, Any]]:
    """Read every row of a data source as ``(where, row)``; ``where`` names the file and row.

    Sources: a ``.jsonl`` file (one JSON object per line), a ``.json`` file (a list of
    objects), a ``.parquet`` file, a directory written by ``datasets``' ``save_to_disk``
    (``split`` picks one of a ``DatasetDict``'s splits), or a directory of such files (with
    ``split``, only those whose name starts with it, as in ``data/train-00000-of-00001.parquet``).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: an unsupported file, unreadable JSON (file and line named), no rows.
        ImportError: Parquet without pyarrow, a datasets directory without datasets.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"dataset {p} does not exist")
    rows: list[tuple[str, Any]] = []
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            rows = list(_hf_dir(p, split))
        else:
            files = sorted(f for f in p.rglob("*") if f.suffix in _SUFFIXES and f.is_file())
            if split is not None:
                files = [f for f in files if f.name.startswith(split)]
            if not files:
                raise ValueError(
                    f"{p} has no {'/'.join(_SUFFIXES)} files"
                    + (f" starting with {split!r}" if split else "")
                    + " and is not a datasets save_to_disk directory"
                )
            for f in files:
                rows += read_rows(f)
    elif p.suffix == ".jsonl":
        rows = list(_jsonl(p))
    elif p.suffix == ".json":
        rows = list(_json(p))
    elif p.suffix == ".parquet":
        rows = list(_parquet(p))
    else:
        raise ValueError(
            f"{p}: unsupported data file; use .jsonl, .json, .parquet or a datasets directory"
        )
    if not rows:
        raise ValueError(f"dataset {p} has no rows")
    return rows


def _fields(template: str) -> list[str]:
    names = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    return [n.split(".")[0].split("[")[0] for n in names]


def _normalize(text: str) -> str:
    return " ".join(str(text).strip().rstrip(".").split()).casefold()


@dataclass(kw_only=True, slots=True)
class DatasetTask:
    """Prompts (and labels) read from a dataset.

    Attributes:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a ``datasets`` directory or a
            directory of data files (see :func:`read_rows`).
        prompt_field: the row field that holds the prompt: a string (one user message) or a
            list of chat messages (``{"role", "content"}``). Exactly one of ``prompt_field``
            and ``template``.
        template: a ``str.format`` template over the row's fields, e.g.
            ``"{question}\\nAnswer with a number."``; the result is one user message.
        label_field: the row field the reward grades against (``None``: no label).
        system_prompt: an optional system message put before every prompt.
        split: which split of a ``datasets`` DatasetDict (or file-name prefix in a directory).
        shuffle: serve the rows in a seeded random order, reshuffled each epoch.
        seed: the shuffle's seed.
        limit: use only the first ``limit`` rows (after reading, before shuffling).
    """

    path: str
    prompt_field: str | None = None
    template: str | None = None
    label_field: str | None = "answer"
    system_prompt: str | None = None
    split: str | None = None
    shuffle: bool = True
    seed: int = 0
    limit: int | None = None
    items: list[PromptItem] = field(init=False, repr=False)
    _order: list[int] = field(init=False, repr=False)
    _pos: int = field(init=False, repr=False)
    _epoch: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.prompt_field is None) == (self.template is None):
            raise ValueError(
                "task.params needs exactly one of prompt_field (a row field holding the prompt) "
                "and template (e.g. '{question}')"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"task.params.limit must be >= 1, got {self.limit}")
        rows = read_rows(self.path, split=self.split)
        if self.limit is not None:
            rows = rows[: self.limit]
        self.items = [self._item(where, row) for where, row in rows]
        self._epoch = 0
        self._pos = 0
        self._order = self._shuffled()

    def _item(self, where: str, row: Any) -> PromptItem:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be an object with fields, got {row!r:.80}")
        need = [self.prompt_field] if self.prompt_field else _fields(self.template or "")
        if self.label_field:
            need.append(self.label_field)
        missing = [f for f in need if f not in row]
        if missing:
            raise ValueError(
                f"{where}: missing field{'s' if len(missing) > 1 else ''} {missing} "
                f"(the row has {sorted(row)})"
            )
        messages: list[dict[str, Any]]
        if self.template is not None:
            messages = [{"role": "user", "content": self.template.format(**row)}]
        else:
            value = row[self.prompt_field]
            if isinstance(value, str):
                messages = [{"role": "user", "content": value}]
            elif isinstance(value, list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in value
            ):
                messages = [dict(m) for m in value]
            else:
                raise ValueError(
                    f"{where}: field {self.prompt_field!r} must be a string or a list of "
                    f"chat messages with role and content, got {value!r:.80}"
                )
        if not any(str(m.get("content") or "").strip() for m in messages):
            raise ValueError(f"{where}: the prompt is empty")
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        label = row[self.label_field] if self.label_field else None
        return PromptItem(messages=messages, label=label, metadata={"source": where})

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self._epoch).shuffle(order)
        return order

    def sample(self, n: int) -> list[PromptItem]:
        """The next ``n`` rows (wrapping into a new, reshuffled epoch at the end)."""
        out: list[PromptItem] = []
        while len(out) < n:
            if self._pos == len(self._order):
                self._epoch += 1
                self._pos = 0
                self._order = self._shuffled()
            out.append(self.items[self._order[self._pos]])
            self._pos += 1
        return out

    def heldout(self, n: int) -> list[PromptItem]:
        """The first ``n`` rows in file order (for evaluation)."""
        return self.items[:n]

    @staticmethod
    def reward(response: str, label: Any) -> float:
        """Exact match after trimming, collapsing spaces, a final period and case (a list
        label accepts any of its items)."""
        labels = label if isinstance(label, list) else [label]
        got = _normalize(response)
        return 1.0 if any(got == _normalize(str(x)) for x in labels) else 0.0
