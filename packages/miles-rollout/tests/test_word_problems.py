"""The seeded word-problem task: reproducible streams, correct labels, the first-number reward."""

from __future__ import annotations

import re

import pytest

from miles_rollout.tasks import WordProblemTask
from miles_rollout.tasks.word_problems import last_number


def _solve(text: str) -> int:
    """Recompute a problem's answer from its words (independent of the generator's count)."""
    boxes = re.search(r"has (\d+) boxes with (\d+) ", text)
    start = re.search(r"has (\d+) ", text)
    assert start is not None
    count = int(boxes[1]) * int(boxes[2]) if boxes else int(start[1])
    for verb, n in re.findall(r"(gives|finds) (\d+)", text):
        count += int(n) if verb == "finds" else -int(n)
    return count


def test_labels_are_the_answers_and_streams_are_seeded() -> None:
    task = WordProblemTask(max_number=10, max_steps=3, multiply=True, seed=5)
    items = task.sample(200)
    for item in items:
        text = item.messages[0]["content"]
        assert text.endswith("Answer with just the number.")
        assert _solve(text) == item.label > 0
    again = WordProblemTask(max_number=10, max_steps=3, multiply=True, seed=5).sample(200)
    assert [i.messages for i in again] == [i.messages for i in items]
    other = WordProblemTask(max_number=10, max_steps=3, seed=6).sample(200)
    assert [i.messages for i in other] != [i.messages for i in items]
    held = {i.messages[0]["content"] for i in task.heldout(50)}
    assert held == {i.messages[0]["content"] for i in task.heldout(50)}  # a fixed set
    assert len(held - {i.messages[0]["content"] for i in items}) > 40


def test_reward_is_the_last_number() -> None:
    assert WordProblemTask.reward("7", 7) == 1.0
    assert WordProblemTask.reward("Mia has 4 + 3 = 7 apples.", 7) == 1.0
    assert WordProblemTask.reward("7 apples. Mia had 4.", 7) == 0.0
    assert WordProblemTask.reward("seven", 7) == 0.0
    assert last_number("x -3 y 2") == 2
    with pytest.raises(ValueError, match="max_steps"):
        WordProblemTask(max_steps=4)
