"""The dataset task: JSONL, JSON, Parquet and Hugging Face datasets directories, with a prompt
template or field, a label field, splits, a seeded order, and errors that name file and row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles_rollout.tasks import DatasetTask

ROWS = [
    {"question": "What is 2+3?", "answer": "5", "id": 0},
    {"question": "What is 7-4?", "answer": "3", "id": 1},
    {"question": "What is 6*2?", "answer": "12", "id": 2},
]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _questions(task: DatasetTask, n: int) -> list[str]:
    return [item.messages[-1]["content"] for item in task.sample(n)]


def test_jsonl_with_a_template_label_and_system_prompt(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    task = DatasetTask(
        path=str(path), template="Q: {question}\nA:", system_prompt="Be brief.", shuffle=False
    )
    items = task.sample(4)  # wraps into a second epoch
    assert [i.label for i in items] == ["5", "3", "12", "5"]
    assert items[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: What is 2+3?\nA:"},
    ]
    assert items[0].metadata["source"] == f"{path}:line 1"
    assert task.reward(" 5. ", "5") == 1.0
    assert task.reward("6", "5") == 0.0


def test_shuffle_is_seeded_and_reshuffles_each_epoch(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    a = _questions(DatasetTask(path=str(path), template="{question}", seed=3), 40)
    b = _questions(DatasetTask(path=str(path), template="{question}", seed=3), 40)
    c = _questions(DatasetTask(path=str(path), template="{question}", seed=4), 40)
    assert a == b
    assert a != c
    assert sorted(a[:20]) == sorted(a[20:]) == sorted(f"q{i}" for i in range(20))
    assert a[:20] != a[20:]


def test_prompt_field_string_or_chat_messages_and_json_lists(tmp_path: Path) -> None:
    chats = [
        {"messages": [{"role": "user", "content": "hi"}], "answer": "hello"},
        {"messages": "plain text", "answer": "ok"},
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(chats))
    task = DatasetTask(path=str(path), prompt_field="messages", shuffle=False)
    assert [i.messages for i in task.sample(2)] == [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "plain text"}],
    ]


def test_parquet_file_and_directory_of_split_files(tmp_path: Path) -> None:
    task = DatasetTask(path=str(_parquet(tmp_path / "d.parquet", ROWS)), template="{question}")
    assert sorted(i.label for i in task.sample(3)) == ["12", "3", "5"]
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    _parquet(data / "train-00000-of-00001.parquet", ROWS[:2])
    _parquet(data / "test-00000-of-00001.parquet", ROWS[2:])
    test = DatasetTask(path=str(tmp_path / "repo"), template="{question}", split="test")
    assert [i.label for i in test.sample(2)] == ["12", "12"]


def test_hugging_face_datasets_directories(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    task = DatasetTask(path=str(single), template="{question}", shuffle=False)
    assert [i.label for i in task.sample(3)] == ["5", "3", "12"]
    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS[:2]),
            "test": datasets.Dataset.from_list(ROWS[2:]),
        }
    ).save_to_disk(str(splits))
    train = DatasetTask(path=str(splits), template="{question}", split="train", shuffle=False)
    assert [i.label for i in train.sample(2)] == ["5", "3"]
    assert train.items[0].metadata["source"] == f"{splits}[train]:row 0"
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\]; choose one"):
        DatasetTask(path=str(splits), template="{question}")
    with pytest.raises(ValueError, match="has no split 'dev'"):
        DatasetTask(path=str(splits), template="{question}", split="dev")


def test_bad_rows_are_errors_at_start_naming_file_and_row(tmp_path: Path) -> None:
    missing = _jsonl(tmp_path / "missing.jsonl", [*ROWS[:2], {"question": "q", "id": 2}])
    with pytest.raises(ValueError, match=r"missing\.jsonl:line 3: missing field \['answer'\]"):
        DatasetTask(path=str(missing), template="{question}")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2 is not valid JSON"):
        DatasetTask(path=str(broken), template="{question}")
    scalar = _jsonl(tmp_path / "scalar.jsonl", [ROWS[0], 7])
    with pytest.raises(ValueError, match=r"scalar\.jsonl:line 2: a row must be an object"):
        DatasetTask(path=str(scalar), template="{question}")
    no_field = _jsonl(tmp_path / "field.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"line 1: missing field \['prompt'\]"):
        DatasetTask(path=str(no_field), prompt_field="prompt")
    parquet = _parquet(tmp_path / "p.parquet", [{"question": "q", "label": "x"}])
    with pytest.raises(ValueError, match=r"p\.parquet:row 0: missing field \['answer'\]"):
        DatasetTask(path=str(parquet), template="{question}")
    with pytest.raises(ValueError, match="exactly one of prompt_field"):
        DatasetTask(path=str(no_field))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DatasetTask(path=str(tmp_path / "nope.jsonl"), template="{question}")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        DatasetTask(path=str(tmp_path / "d.csv"), template="{question}")
