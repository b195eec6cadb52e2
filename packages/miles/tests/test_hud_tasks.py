"""``task.name: hud`` (miles.agentic.HudTaskSet): the mistakes a recipe can make and the one
message each gets, without HUD installed (listing real rows runs in tests/test_e2e_hud.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("miles_env")

from miles.agentic.hud import HudTaskSet, select_rows
from miles.config import TaskSettings
from miles.tasks import make_task

ROWS = [
    {"slug": "add-6348df95", "env": "arith", "id": "add", "args": {"a": 3, "b": 4}},
    {"slug": "speak", "env": "arith", "id": "speak", "args": {}},
]


def test_no_hud_python_names_the_setup_command(tmp_path: Path) -> None:
    params = {"source": "env.py", "python": str(tmp_path / "nope" / "python")}
    with pytest.raises(ValueError, match=r"^task hud: .*setup_agent_frameworks\.sh hud"):
        make_task(TaskSettings(name="hud", params=params))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"source": ""}, r"task\.params\.source must name a HUD environment"),
        ({"source": "env.py", "max_turns": 0}, r"task\.params\.max_turns must be >= 1, got 0"),
        ({"source": "env.py", "runtime": "docker"}, r"task\.params\.runtime must be one of"),
    ],
)
def test_bad_params_are_refused_before_hud_starts(params: dict, match: str) -> None:
    # python points nowhere: a check that came after the bridge would report that instead.
    with pytest.raises(ValueError, match=match):
        HudTaskSet(**params, python="/nope/python")


def test_unknown_task_slugs_list_the_rows_there_are() -> None:
    with pytest.raises(ValueError, match="has no HUD task") as e:
        select_rows(ROWS, ["add", "speak", "nope"], where="env.py")
    assert str(e.value) == (
        "task.params.tasks: env.py has no HUD task 'add', 'nope'; it has: add-6348df95, speak"
    )
    assert select_rows(ROWS, ["speak", "add-6348df95"], where="env.py") == ROWS[::-1]
    assert select_rows(ROWS, None, where="env.py") == ROWS


def test_a_source_without_rows_says_how_to_declare_them() -> None:
    with pytest.raises(ValueError, match=r"env\.py declares no HUD task rows: .*taskset"):
        select_rows([], None, where="env.py")
