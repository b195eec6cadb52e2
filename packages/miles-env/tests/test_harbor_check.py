"""The terminal-task suite (every task 1.0 with its oracle, 0.0 with a no-op agent), bad task
directories (reward 0 with the reason, the run goes on, sandboxes cleaned up) and the
``miles-env check`` command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _env_testlib import needs_local

from miles_env.backends.cgroups import CgroupHost
from miles_env.harbor import TaskResult, builtin_tasks_dir, check_tasks
from miles_env.sandbox import open_sandboxes

pytestmark = needs_local

GOOD = "edit-config"  # a quick task of the suite, copied and broken below


def _no_leftovers() -> None:
    assert open_sandboxes() == []
    host = CgroupHost.discover()
    bases = [*host.v1.values(), *([host.v2] if host.v2 else [])]
    mine = [
        p
        for b in bases
        if (b / "miles-env").is_dir()
        for p in (b / "miles-env").iterdir()
        if p.name.startswith(f"{os.getpid()}-")
    ]
    assert mine == []


@pytest.mark.parametrize(("policy", "want"), [("oracle", 1.0), ("noop", 0.0)])
def test_builtin_suite(policy: str, want: float) -> None:
    results = check_tasks(policy=policy)  # type: ignore[arg-type]
    assert len(results) >= 10
    for r in results:
        assert not r.error, (r.task, r.reason)
        assert r.reward == want, (r.task, r.reason)
        if policy == "oracle":
            assert r.agent_exit_code == 0, r.task
    _no_leftovers()


BAD_NAMES = ("good", "no-test", "crash", "silent", "hang", "garbage", "json", "no-solution")


def _suite_of_bad_tasks(root: Path) -> Path:
    src = builtin_tasks_dir() / GOOD
    for name in (*BAD_NAMES, "stuck-agent"):
        shutil.copytree(src, root / name)
    (root / "no-test" / "tests" / "test.sh").unlink()
    (root / "crash" / "tests" / "test.sh").write_text("echo 'verifier broke' >&2\nexit 3\n")
    (root / "silent" / "tests" / "test.sh").write_text("echo checked\n")
    (root / "hang" / "tests" / "test.sh").write_text("sleep 600\n")
    toml = (root / "hang" / "task.toml").read_text()
    (root / "hang" / "task.toml").write_text(
        toml.replace("timeout_sec = 60.0", "timeout_sec = 1.0")
    )
    (root / "garbage" / "tests" / "test.sh").write_text("echo 'one' > /logs/verifier/reward.txt\n")
    (root / "json" / "tests" / "test.sh").write_text(
        'echo \'{"reward": 0.5, "style": 1}\' > /logs/verifier/reward.json\n'
    )
    shutil.rmtree(root / "no-solution" / "solution")
    # An agent that never stops: stopped at the agent timeout, then verified as it left things.
    (root / "stuck-agent" / "solution" / "solve.sh").write_text("sleep 600\n")
    toml = (root / "stuck-agent" / "task.toml").read_text()
    (root / "stuck-agent" / "task.toml").write_text(
        toml.replace("[agent]\ntimeout_sec = 120.0", "[agent]\ntimeout_sec = 1.0")
    )
    return root


def test_bad_tasks(tmp_path: Path) -> None:
    results = {r.task: r for r in check_tasks(_suite_of_bad_tasks(tmp_path), "oracle")}
    assert sorted(results) == sorted([*BAD_NAMES, "stuck-agent"])

    def bad(name: str, *fragments: str) -> TaskResult:
        r = results[name]
        assert r.error, name
        assert r.reward == 0.0, name
        for f in fragments:
            assert f in r.reason, (name, r.reason)
        return r

    assert results["good"].reward == 1.0  # the run went on around the broken ones
    assert not results["good"].error
    bad("no-test", "missing tests/test.sh")
    bad("crash", "verifier exited 3 without writing", "verifier broke")
    assert bad("silent", "verifier exited 0 without writing", "checked").verifier_exit_code == 0
    assert bad("hang", "verifier timed out after 1 s").verifier_exit_code == 124
    bad("garbage", "reward.txt holds 'one', not a number")
    bad("no-solution", "missing solution/solve.sh")
    assert results["json"].reward == 0.5
    assert not results["json"].error
    stuck = results["stuck-agent"]
    assert (stuck.reward, stuck.error, stuck.agent_exit_code) == (0.0, False, 124)
    assert "solve.sh timed out after 1 s" in stuck.notes
    _no_leftovers()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_env", "check", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli(tmp_path: Path) -> None:
    one = tmp_path / "one"
    shutil.copytree(builtin_tasks_dir() / GOOD, one / GOOD)
    r = _cli(str(one))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(GOOD)
    assert "reward 1.00" in lines[0]
    assert lines[-1].startswith(
        "1 tasks, policy oracle: mean reward 1.000, 1 at 1.0, 0 could not run"
    )

    r = _cli(str(one), "--policy", "noop", "--json")
    assert r.returncode == 0, r.stderr
    (obj,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert (obj["task"], obj["reward"], obj["error"]) == (GOOD, 0.0, False)

    broken = tmp_path / "broken"
    shutil.copytree(one, broken)
    shutil.copytree(builtin_tasks_dir() / GOOD, broken / "incomplete")
    (broken / "incomplete" / "instruction.md").unlink()
    r = _cli(str(broken), "--json")
    assert r.returncode == 1  # not every task could be run
    rows = {o["task"]: o for o in map(json.loads, r.stdout.splitlines())}
    assert rows[GOOD]["reward"] == 1.0
    assert rows["incomplete"]["reward"] == 0.0
    assert "missing instruction.md" in rows["incomplete"]["reason"]

    r = _cli(str(tmp_path / "nowhere"))
    assert r.returncode == 2
    assert "no such directory" in r.stderr
