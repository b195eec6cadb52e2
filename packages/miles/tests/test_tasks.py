"""Tasks and reward functions by name: what a new user gets wrong, and the message they see."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.cli import main
from miles.config import TaskSettings, builtin_recipes
from miles.tasks import load_callable, make_reward_fn, make_task
from miles_rollout import Sample

USER_MODULE = """
from miles_rollout.types import PromptItem


class Echo:
    def __init__(self, word="hi"):
        self.word = word

    def sample(self, n):
        return [PromptItem(messages=[{"role": "user", "content": self.word}], label=self.word)] * n

    def reward(self, response, label):
        return float(response == label)


class DictTask(Echo):
    def sample(self, n):
        return [{"prompt": self.word, "label": self.word}] * n


def dicts(**params):
    return [{"prompt": "1+1=", "label": 2}]


def exact(sample):
    return float(sample.response == sample.label)


def two_args(sample, extra):
    return 0.0
"""


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory holding the user's module (not installed, not on sys.path)."""
    (tmp_path / "first_hour_user.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    yield tmp_path
    sys.path[:] = before
    sys.modules.pop("first_hour_user", None)


def test_the_working_directory_is_importable(user_dir: Path) -> None:
    assert str(user_dir) not in sys.path
    fn = load_callable("first_hour_user:exact")
    assert fn.__name__ == "exact"
    assert sys.path[-1] == str(user_dir)  # appended: never shadows an installed package
    with pytest.raises(ValueError, match=r"cannot import module 'nope_mod'.*working directory"):
        load_callable("nope_mod:f")


def test_unknown_task_lists_the_builtin_ones() -> None:
    with pytest.raises(ValueError, match="unknown task") as e:
        make_task(TaskSettings(name="nosuch"))
    msg = str(e.value)
    assert "unknown task 'nosuch'" in msg
    assert "arithmetic, guess_number" in msg
    assert "package.module:factory" in msg


def test_a_factory_must_return_a_task(user_dir: Path) -> None:
    with pytest.raises(ValueError, match="task factory") as e:
        make_task(TaskSettings(name="first_hour_user:dicts"))
    msg = str(e.value)
    assert "task factory 'first_hour_user:dicts' returned list" in msg
    assert "sample(n) -> list[PromptItem]" in msg
    assert "miles_rollout.types.Task" in msg


def test_a_task_must_yield_prompt_items(user_dir: Path) -> None:
    good = make_task(TaskSettings(name="first_hour_user:Echo", params={"word": "yo"}))
    (item,) = good.sample(1)
    assert item.label == "yo"
    task = make_task(TaskSettings(name="first_hour_user:DictTask"))
    with pytest.raises(ValueError, match="PromptItem") as e:
        task.sample(2)
    msg = str(e.value)
    assert "task 'first_hour_user:DictTask': sample(2) returned a dict" in msg
    assert "miles_rollout.PromptItem(messages=" in msg
    with pytest.raises(ValueError, match="bad params"):
        make_task(TaskSettings(name="first_hour_user:Echo", params={"nope": 1}))


def test_reward_functions_by_name(user_dir: Path) -> None:
    task = make_task(TaskSettings(name="arithmetic"))
    own = make_reward_fn(TaskSettings(), task)
    assert own.reward_name == "miles_rollout.tasks.arithmetic:ArithmeticTask.reward"  # type: ignore[attr-defined]
    sample = Sample(group_index=0, index=0, prompt="1+1=", label=2, response="2")
    assert own(sample) == 1.0
    custom = make_reward_fn(TaskSettings(reward_fn="first_hour_user:exact"), task)
    assert custom(sample) == 0.0
    with pytest.raises(ValueError, match=r"cannot be called as fn\(sample\)"):
        make_reward_fn(TaskSettings(reward_fn="first_hour_user:two_args"), task)


def test_miles_recipes_shows_one_line_per_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == builtin_recipes()
    demo = next(line for line in lines if line.startswith("arith-tiny "))
    assert "two-digit addition" in demo
    assert all(len(line.split(None, 1)) == 2 for line in lines), lines  # every one described
