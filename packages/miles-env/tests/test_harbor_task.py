"""Reading Harbor task directories and the Dockerfile subset the local backend replays."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_env.harbor import TaskError, builtin_tasks_dir, find_tasks, load_task
from miles_env.harbor.dockerfile import parse_dockerfile


def test_builtin_suite_layout() -> None:
    tasks = find_tasks(builtin_tasks_dir())
    assert len(tasks) >= 10
    for path in tasks:
        t = load_task(path)
        assert t.instruction.strip()
        assert t.solution is not None
        assert (path / "environment" / "Dockerfile").is_file()
        assert t.workdir == "/app"
        assert t.agent_timeout_s == 120.0
        assert t.verifier_timeout_s == 60.0
        assert t.memory_mb == 512
        assert t.plan.copies == [("app", "/app/")]
        assert t.metadata["difficulty"] in ("easy", "medium", "hard")


def test_dockerfile_subset(tmp_path: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text(
        "# comment\n"
        "FROM python:3.11-slim\n"
        "ARG X=1\n"
        "ENV A=1 B='two words'\n"
        "ENV LEGACY some value\n"
        "WORKDIR /srv\n"
        "WORKDIR app\n"
        "COPY --chown=1000:1000 a.txt b/ ./sub/\n"
        'COPY ["c d.txt", "/etc/c.txt"]\n'
        "ADD e.txt $A.txt\n"
        "RUN apt-get update && \\\n"
        "    apt-get install -y jq\n"
        "USER nobody\n"
    )
    plan = parse_dockerfile(df)
    assert plan.workdir == "/srv/app"
    assert plan.env == {"A": "1", "B": "two words", "LEGACY": "some value"}
    assert plan.copies == [
        ("a.txt", "/srv/app/sub/"),
        ("b", "/srv/app/sub/"),
        ("c d.txt", "/etc/c.txt"),
        ("e.txt", "/srv/app/1.txt"),
    ]
    assert plan.ignored == [
        "ARG X=1",
        "RUN apt-get update &&  apt-get install -y jq",
        "USER nobody",
    ]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("COPY --from=build /out /app", "another stage"),
        ("ADD https://example.invalid/x.tgz /app", "URL"),
        ("COPY ../secret /app", "outside the build context"),
        ("COPY onlyone", "source and a destination"),
    ],
)
def test_dockerfile_refusals(tmp_path: Path, line: str, match: str) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text(f"FROM x\n{line}\n")
    with pytest.raises(ValueError, match=match):
        parse_dockerfile(df)


def _task(root: Path, **files: str) -> Path:
    for rel, text in files.items():
        p = root / rel.replace("__", "/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_load_task_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"missing tests/test\.sh"):
        load_task(_task(tmp_path / "a", **{"task.toml": "", "instruction.md": "x"}))
    bad_toml = _task(
        tmp_path / "b", **{"task.toml": "[agent\n", "instruction.md": "x", "tests__test.sh": ""}
    )
    with pytest.raises(TaskError, match=r"task\.toml"):
        load_task(bad_toml)
    bad_value = _task(
        tmp_path / "c",
        **{
            "task.toml": '[agent]\ntimeout_sec = "soon"\n',
            "instruction.md": "x",
            "tests__test.sh": "",
        },
    )
    with pytest.raises(TaskError, match=r"task\.toml"):
        load_task(bad_value)
    missing_copy = _task(
        tmp_path / "d",
        **{
            "task.toml": "",
            "instruction.md": "x",
            "tests__test.sh": "",
            "environment__Dockerfile": "FROM x\nCOPY nothere /app/\n",
        },
    )
    with pytest.raises(TaskError, match="copies nothere, which does not exist"):
        load_task(missing_copy)


def test_find_tasks(tmp_path: Path) -> None:
    (tmp_path / "t1").mkdir()
    (tmp_path / "t2").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "notes.txt").write_text("")
    assert [p.name for p in find_tasks(tmp_path)] == ["t1", "t2"]
    (tmp_path / "t1" / "task.toml").write_text("")
    assert find_tasks(tmp_path / "t1") == [tmp_path / "t1"]
    with pytest.raises(FileNotFoundError):
        find_tasks(tmp_path / "nope")
