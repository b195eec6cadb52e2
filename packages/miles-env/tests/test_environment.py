"""The Environment protocol on Harbor tasks: `TerminalEnv` driven by `run_episode` with a
scripted chat function (real sandboxes, real verifiers), the coding tools, and bad input: a
task missing a file, a verifier that crashes, tool calls with bad arguments, an agent that
never stops, a full context, a failing endpoint. Every episode's sandbox is closed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from _env_testlib import Loop, needs_local

from miles_env.environment import (
    ChatError,
    ContextFullError,
    Environment,
    TerminalEnv,
    TerminalEnvConfig,
    ToolArgumentsError,
    parse_arguments,
    run_episode,
)
from miles_env.environment.tools import TOOLSETS, clip
from miles_env.harbor import TaskError, builtin_tasks_dir
from miles_env.rollout import EpisodeError, episode_reward
from miles_env.sandbox import open_sandboxes

TASKS = builtin_tasks_dir()


def call(name: str, arguments: Any, cid: str = "") -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": cid or f"c-{name}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


class Script:
    """A chat function that answers from a list of replies (tool-call lists or text), then
    repeats its last one; it records what it was asked."""

    def __init__(self, replies: Iterable[list[dict[str, Any]] | str]) -> None:
        self.replies = list(replies)
        self.seen: list[list[dict[str, Any]]] = []
        self.tools: list[dict[str, Any]] = []

    async def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        self.seen.append([dict(m) for m in messages])
        self.tools = tools
        reply = self.replies[min(len(self.seen) - 1, len(self.replies) - 1)]
        if isinstance(reply, str):
            return {"role": "assistant", "content": reply}
        return {"role": "assistant", "content": "", "tool_calls": reply}


def _solve(task: str) -> str:
    return (TASKS / task / "solution" / "solve.sh").read_text()


def test_parse_arguments() -> None:
    bash = TOOLSETS["bash"][0]
    assert parse_arguments(call("bash", {"command": "ls"}), bash) == {"command": "ls"}
    assert parse_arguments(call("bash", {"command": "ls", "timeout_s": 2}), bash)["timeout_s"] == 2
    for args, fragment in (
        ('{"command": "ls"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({}, "missing argument command"),
        ({"cmd": "ls"}, "missing argument command"),
        ({"command": "ls", "cwd": "/"}, "unknown argument cwd"),
        ({"command": 3}, "argument command must be string"),
        ({"command": "ls", "timeout_s": True}, "argument timeout_s must be number"),
    ):
        with pytest.raises(ToolArgumentsError, match=fragment) as e:
            parse_arguments(call("bash", args), bash)
        assert "it takes {command: string, timeout_s: number?}" in str(e.value)
    assert clip("x" * 50, 100) == "x" * 50
    cut = clip("a" * 100 + "b" * 100, 100)
    assert cut == "a" * 40 + "\n[... 100 characters cut ...]\n" + "b" * 60


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="toolset must be one of"):
        TerminalEnvConfig(toolset="gui")
    with pytest.raises(ValueError, match="backend must be one of"):
        TerminalEnvConfig(backend="docker")
    with pytest.raises(ValueError, match="unknown TerminalEnvConfig field tool_set"):
        TerminalEnvConfig.coerce({"tool_set": "bash"})
    assert isinstance(TerminalEnv(), Environment)


@needs_local
def test_oracle_episode(loop: Loop) -> None:
    """The oracle's commands as tool calls: reward 1.0; the conversation and the counters say
    what happened, tool outputs come back as tool messages with their call ids."""
    chat = Script(
        [
            [call("bash", {"command": "ls; echo oops >&2; exit 3"}, "t1")],
            [call("bash", {"command": _solve("csv-totals")}, "t2")],
            "Done.",
        ]
    )
    r = loop.run(run_episode(TerminalEnv(), TASKS / "csv-totals", chat, max_turns=8))
    assert (r.reward, r.stopped, r.scores) == (1.0, "done", {"reward": 1.0})
    first = chat.seen[0]
    assert [m["role"] for m in first] == ["system", "user"]
    assert "/app" in first[0]["content"]
    assert "Revenue per region" in first[1]["content"]
    assert [t["function"]["name"] for t in chat.tools] == ["bash"]
    tool_msgs = [m for m in r.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["t1", "t2"]
    assert tool_msgs[0]["content"] == "exit code 3\nsales.csv\n[stderr]\noops"
    m = r.metrics
    assert (m["turns"], m["tool_calls"], m["tool_errors"], m["nonzero_exits"]) == (3, 2, 0, 1)
    assert m["sandbox_s"] > 0
    assert 0 < m["sandbox_frac"] <= 1
    md = r.to_metadata()
    assert md["task"] == "csv-totals"
    assert md["metrics"]["agentic/reward/csv-totals"] == 1.0
    assert episode_reward(type("S", (), {"metadata": md})()) == 1.0
    assert open_sandboxes() == []


@needs_local
def test_coding_tools(loop: Loop) -> None:
    """read_file / edit_file / write_file fix python-bug; their errors are tool errors; a
    rewritten file keeps its mode."""
    words = "/app/textstats/words.py"
    chat = Script(
        [
            [call("read_file", {"path": "textstats/words.py"})],
            [
                call(
                    "edit_file",
                    {
                        "path": words,
                        "old_text": 'findall(r"[a-z\']+", text)',
                        "new_text": 'findall(r"[a-z\']+", text.lower())',
                    },
                ),
                call(
                    "edit_file",
                    {
                        "path": words,
                        "old_text": "kv[1], kv[0]), reverse=True",
                        "new_text": "-kv[1], kv[0])",
                    },
                ),
            ],
            [
                call("edit_file", {"path": words, "old_text": "no such text", "new_text": ""}),
                call("read_file", {"path": "/app/missing.txt"}),
                call("write_file", {"path": "/app/run.sh", "content": "#!/bin/sh\necho ran\n"}),
                call("bash", {"command": "chmod 755 run.sh"}),
                call("write_file", {"path": "/app/run.sh", "content": "#!/bin/sh\necho again\n"}),
                call("bash", {"command": "./run.sh && stat -c %a run.sh"}),
            ],
            "Fixed.",
        ]
    )
    r = loop.run(run_episode(TerminalEnv({"toolset": "coding"}), TASKS / "python-bug", chat))
    assert (r.reward, r.stopped) == (1.0, "done"), r.info
    assert [t["function"]["name"] for t in chat.tools] == [
        "bash",
        "read_file",
        "write_file",
        "edit_file",
    ]
    out = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert "def top_words(text, n):" in out[0]
    assert out[1:3] == [f"edited {words}", f"edited {words}"]
    assert "old_text occurs 0 times" in out[3]
    assert out[4].startswith("error: read_file: /app/missing.txt:")
    assert out[5] == "wrote 19 bytes to /app/run.sh"
    assert out[8] == "exit code 0\nagain\n755"
    assert (r.metrics["tool_calls"], r.metrics["tool_errors"]) == (9, 2)
    assert open_sandboxes() == []


@needs_local
def test_bad_tool_calls_and_runaway_agent(loop: Loop) -> None:
    """Bad arguments and unknown tools answer with the reason and the episode goes on; an
    agent that never stops is stopped at max_turns and judged on what it left (nothing: 0);
    a command past its timeout is killed."""
    bad = [
        call("bash", '{"command": "ls"'),
        call("bash", {"cmd": "ls"}),
        call("shell", {"command": "ls"}),
        call("bash", {"command": "sleep 30", "timeout_s": 0.5}),
    ]
    chat = Script([bad, [call("bash", {"command": "ls"})]])
    r = loop.run(run_episode(TerminalEnv(), TASKS / "edit-config", chat, max_turns=4))
    assert (r.reward, r.stopped) == (0.0, "max_turns")
    out = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert "arguments are not valid JSON" in out[0]
    assert "missing argument command" in out[1]
    assert out[2] == "error: unknown tool 'shell'; the tools are bash"
    assert out[3].startswith("exit code 124 (killed after 0.5 s)")
    m = r.metrics
    assert (
        m["turns"],
        m["tool_calls"],
        m["tool_errors"],
        m["tool_timeouts"],
        m["max_turns_hit"],
    ) == (4, 7, 3, 1, 1)
    assert open_sandboxes() == []


def _broken_tasks(root: Path) -> Path:
    for name in ("no-test", "crash", "silent"):
        shutil.copytree(TASKS / "edit-config", root / name)
    (root / "no-test" / "tests" / "test.sh").unlink()
    (root / "crash" / "tests" / "test.sh").write_text("echo 'verifier broke' >&2\nexit 3\n")
    (root / "silent" / "tests" / "test.sh").write_text("echo checked\n")
    return root


@needs_local
def test_broken_tasks(loop: Loop, tmp_path: Path) -> None:
    """A task missing a file fails at reset with the reason (no sandbox left); a verifier that
    crashes or writes no reward gives reward 0 with the reason, and episode_reward raises so
    the run's reward_errors policy decides."""
    root = _broken_tasks(tmp_path)
    with pytest.raises(TaskError, match=r"missing tests/test\.sh"):
        loop.run(run_episode(TerminalEnv(), root / "no-test", Script(["done"])))
    assert open_sandboxes() == []
    for name, fragment in (
        ("crash", "verifier exited 3 without writing"),
        ("silent", "exited 0 without writing"),
    ):
        r = loop.run(run_episode(TerminalEnv(), root / name, Script(["done"])))
        assert (r.reward, r.metrics["verifier_error"]) == (0.0, 1.0)
        md = r.to_metadata()
        assert fragment in md["verifier_error"]
        with pytest.raises(EpisodeError, match=fragment):
            episode_reward(type("S", (), {"metadata": md})())
    assert open_sandboxes() == []


@needs_local
def test_chat_failures(loop: Loop) -> None:
    """A full context ends the episode and the verifier still judges it; any other chat
    failure fails the episode, with its sandbox closed."""

    async def full(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        if len(messages) > 2:
            raise ContextFullError(400, "over the engine's context length (64)")
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("bash", {"command": _solve("edit-config")})],
        }

    r = loop.run(run_episode(TerminalEnv(), TASKS / "edit-config", full))
    assert (r.reward, r.stopped, r.metrics["context_full"], r.metrics["turns"]) == (
        1.0,
        "context_full",
        1.0,
        1,
    )

    async def broken(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        raise ChatError(502, "engine down")

    with pytest.raises(ChatError, match="engine down"):
        loop.run(run_episode(TerminalEnv(), TASKS / "edit-config", broken))
    assert open_sandboxes() == []
