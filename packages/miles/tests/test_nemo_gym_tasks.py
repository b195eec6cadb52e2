"""``task.name: nemo_gym`` (miles.agentic.NemoGymTaskSet): the mistakes a recipe can make and
the one message each gets, and the seeded draw of rows, without NeMo Gym installed (``python``
points at this interpreter: the taskset only checks that NeMo Gym's Python exists; episodes
run in tests/test_e2e_nemo_gym.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("miles_env")

from miles.agentic import NemoGymTaskSet
from miles.config import TaskSettings
from miles.tasks import make_task


def _row(a: int, b: int, **extra: object) -> dict:
    params = {
        "input": [
            {"role": "developer", "content": "Use the tools."},
            {"role": "user", "content": [{"type": "input_text", "text": f"What is {a} + {b}?"}]},
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
    }
    return {"responses_create_params": params, "a": a, "b": b, **extra}


ROWS = [_row(1, 2, id="one"), _row(3, 4, id="two"), _row(5, 6)]
OK: dict[str, Any] = {"resources_url": "http://127.0.0.1:9", "python": sys.executable}


def _jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_no_nemo_gym_python_names_the_setup_command(tmp_path: Path) -> None:
    params = {"rows": ROWS, "resources_url": OK["resources_url"], "python": str(tmp_path / "py")}
    with pytest.raises(ValueError, match=r"^task nemo_gym: .*setup_agent_frameworks\.sh nemo-gym"):
        make_task(TaskSettings(name="nemo_gym", params=params))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rows": ROWS}, r"needs one resources server: task\.params\.resources_server"),
        (
            {"rows": ROWS, "resources_server": "s.py:S", "resources_url": "http://h:1"},
            r"needs one resources server",
        ),
        ({"rows": ROWS, "resources_url": "127.0.0.1:8000"}, r"resources_url must be .*base URL"),
        ({"rows": ROWS, "resources_server": "app.py"}, r"'file\.py:Class' or 'module:Class'"),
        ({"rows": ROWS, "resources_server": "nope.py:S"}, r"resources_server: nope\.py does not"),
        ({**OK, "rows": ROWS, "max_turns": 0}, r"task\.params\.max_turns must be >= 1, got 0"),
        ({**OK}, r"task nemo_gym needs task rows: set task\.params\.data"),
        ({**OK, "data": "missing.jsonl"}, r"task\.params\.data: missing\.jsonl does not exist"),
        ({**OK, "rows": [{"input": "hi"}]}, r"^task\.params\.rows\[0\]: .* got keys \['input'\]"),
        ({**OK, "rows": ROWS, "tasks": ["two", "six"]}, r"no NeMo Gym row has id 'six'; the "),
    ],
)
def test_bad_params_name_the_key_and_the_fix(params: dict, match: str) -> None:
    python: dict[str, Any] = {"python": "/nope/python"}  # checks before the Python's come first
    with pytest.raises(ValueError, match=match):
        NemoGymTaskSet(**{**python, **params})


def test_a_bad_jsonl_row_names_its_file_and_line(tmp_path: Path) -> None:
    good = json.dumps(ROWS[0])
    bad_json = _jsonl(tmp_path / "a.jsonl", [good, "", "{not json"])
    with pytest.raises(ValueError, match=rf"^task\.params\.data: {bad_json}:3: not JSON"):
        NemoGymTaskSet(data=bad_json, **OK)
    no_params = _jsonl(tmp_path / "b.jsonl", [good, json.dumps({"id": "x", "input": []})])
    with pytest.raises(ValueError, match=rf"^{no_params}:2: .*needs responses_create_params"):
        NemoGymTaskSet(data=no_params, **OK)
    not_object = _jsonl(tmp_path / "c.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=rf"^{not_object}:1: .* got list"):
        NemoGymTaskSet(data=not_object, **OK)


def test_rows_are_drawn_in_a_seeded_order_with_what_the_agent_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _jsonl(tmp_path / "rows.jsonl", [json.dumps(r) for r in ROWS[:2]])
    server = tmp_path / "server.py"
    server.write_text("")
    params: dict[str, Any] = {
        "data": data,
        "rows": ROWS[2:],
        "python": sys.executable,
        "max_turns": 3,
    }
    monkeypatch.chdir(tmp_path)  # a relative resources_server is made absolute for the bridge
    task = make_task(
        TaskSettings(name="nemo_gym", params={**params, "resources_server": "server.py:S"})
    )
    assert isinstance(task, NemoGymTaskSet)
    assert task.names == ["one", "two", "row-2"]
    items = task.sample(6)
    assert sorted(i.label for i in items[:3]) == sorted(i.label for i in items[3:])
    assert sorted(i.label for i in items[:3]) == ["one", "row-2", "two"]
    again = NemoGymTaskSet(**{**params, "resources_server": f"{server}:S"}).sample(6)
    assert [i.label for i in again] == [i.label for i in items]  # the seed fixes the order
    other = NemoGymTaskSet(**{**params, "resources_server": f"{server}:S", "seed": 1})
    assert [i.label for i in other.sample(6)] != [i.label for i in items]
    item = next(i for i in items if i.label == "two")
    assert item.messages == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    assert item.metadata["task"] == "two"
    assert item.metadata["max_turns"] == 3
    spec = item.metadata["nemo_gym"]
    assert spec["row"] == ROWS[1]  # as read: /verify gets the row's own fields
    assert spec["resources_server"] == f"{server.resolve()}:S"
    assert spec["resources_url"] is None
    assert spec["python"] == sys.executable
    picked = NemoGymTaskSet(rows=ROWS, tasks=["row-2", "one"], **OK)
    assert picked.names == ["row-2", "one"]
    with pytest.raises(ValueError, match=r"miles_env\.rollout:episode_reward"):
        task.reward("7", "two")
