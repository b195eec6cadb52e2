"""Framework integrations against the real frameworks, each run in its own Python (they pin
other versions of openai / mcp / pydantic than Miles): an OpenEnv environment server
(``create_app``: ``/schema``, the ``/ws`` session) driven by `run_episode` with a scripted
chat, and a Verifiers taskset (its toolset and rubric) through the Verifiers bridge. The
frameworks' Pythons come from ``tools/setup_agent_frameworks.sh`` (or
``MILES_ENV_PYTHON_<NAME>``); without one the test is skipped with the reason.

NeMo Gym's resources server as an `Environment` (``NemoGymEnv``) is tested in the top-level
``tests/test_e2e_nemo_gym.py``, beside NeMo Gym's own agent loop, so that one NeMo Gym process
(about 4 s to start) serves both."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _env_testlib import Loop

from miles_env.environment import run_episode

pytest.importorskip("aiohttp")

HERE = Path(__file__).parent / "frameworks"


def framework_python(name: str) -> Path:
    """The Python of a framework's own environment, or skip."""
    env = os.environ.get(f"MILES_ENV_PYTHON_{name.upper().replace('-', '_')}")
    cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
    python = Path(env) if env else cache / "frameworks" / name / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{name} is not installed: run tools/setup_agent_frameworks.sh ({python})")
    return python


def _serve(python: Path, script: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [str(python), str(HERE / script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the server prints its port once it listens
        m = re.match(r"PORT (\d+)", line)
        if m is None:
            proc.kill()
            raise RuntimeError(f"{script} did not start: {line!r} {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{m.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    yield from _serve(framework_python("openenv"), "openenv_server.py")


def _call(cid: str, name: str, args: Any) -> dict[str, Any]:
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


def test_openenv_ws_session(loop: Loop, openenv_url: str) -> None:
    """A binary-searching agent plays OpenEnv's guess environment through the /ws session:
    the episode ends when the server says done, the reward is the server's."""
    from miles_env.integrations.openenv import OpenEnvEnv

    lo_hi = [1, 16]

    async def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        fn = tools[0]["function"]
        assert fn["name"] == "guess"
        assert fn["parameters"]["required"] == ["guess"]
        assert "metadata" not in fn["parameters"]["properties"]
        last = messages[-1]
        if last["role"] == "tool":
            assert (
                last["content"].startswith("{")
                or "argument guess must be integer" in last["content"]
            )
            hint = (
                json.loads(last["content"].split("\n")[0])["hint"]
                if last["content"].startswith("{")
                else ""
            )
            g = (lo_hi[0] + lo_hi[1]) // 2
            if hint == "higher":
                lo_hi[0] = g + 1
            elif hint == "lower":
                lo_hi[1] = g - 1
        else:
            assert "guess a number from 1 to 16" in last["content"]
            return {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call("bad", "guess", {"guess": "eight"})],
            }
        g = (lo_hi[0] + lo_hi[1]) // 2
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call(f"g{g}", "guess", {"guess": g})],
        }

    env = OpenEnvEnv(openenv_url, tool_name="guess")
    task = {"name": "guess", "prompt": "Guess the secret number.", "reset": {"seed": 3}}
    r = loop.run(run_episode(env, task, chat, max_turns=10))
    assert (r.reward, r.stopped, r.scores["final"]) == (1.0, "env_done", 1.0), r.messages
    secret = r.info["state"]["secret"]
    guesses = [
        json.loads(m["tool_calls"][0]["function"]["arguments"])["guess"]
        for m in r.messages
        if m.get("tool_calls")
    ]
    assert guesses[-1] == secret
    assert r.info["state"]["guesses"] == len(guesses) - 1  # the bad call never reached the server
    assert r.metrics["tool_errors"] == 1
    wrong = secret % 16 + 1

    async def stubborn(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call("w", "guess", {"guess": wrong})],
        }

    r2 = loop.run(
        run_episode(OpenEnvEnv(openenv_url, tool_name="guess"), task, stubborn, max_turns=2)
    )
    assert (r2.stopped, r2.reward, r2.info["state"]["guesses"]) == ("max_turns", 0.0, 2)


def test_hud_templates() -> None:
    """HUD's own TaskRunner runs @env.template generators: the prompt opens the episode, the
    agent's last reply is graded; a template that grades with garbage gives reward 0 and the
    reason; an unknown template names the ones there are."""
    python = framework_python("hud")
    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.run(
        [str(python), str(HERE / "hud_episode.py")],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    right, wrong, broken, unknown = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (right["reward"], right["stopped"]) == (1.0, "done")
    assert right["messages"][0]["content"] == "What is 20 + 22? Answer with the number."
    assert "this task has no tools" in right["messages"][2]["content"]
    assert wrong["reward"] == 0.0
    assert broken["reward"] == 0.0
    assert "failed to grade: task graded with str" in broken["reason"]
    assert unknown["error"] == "HUD environment 'arith' has no template 'nope'; it has add, broken"


def test_verifiers_taskset(loop: Loop) -> None:
    """A Verifiers taskset through the bridge in Verifiers' Python: the task's system prompt
    and prompt open the episode, its toolset's ``add`` is the tool (schema from Verifiers'
    own MCP registration), bad calls come back as errors, and the task's rubric scores the
    conversation: each reward by name and the weighted total."""
    from miles_env.integrations.verifiers import VerifiersEnv, VerifiersError

    python = framework_python("verifiers")

    async def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        fn = tools[0]["function"]
        assert (fn["name"], fn["parameters"]["required"]) == ("add", ["a", "b"])
        if messages[-1]["role"] == "user":
            calls = [
                _call("c0", "add", {"a": "two"}),
                _call("c1", "sub", {}),
                _call("c2", "add", {"a": 20, "b": 22}),
            ]
            return {"role": "assistant", "content": "", "tool_calls": calls}
        return {"role": "assistant", "content": f"The sum is {messages[-1]['content']}."}

    async def silent(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": "I do not know."}

    async def play() -> tuple[Any, Any, list[dict[str, Any]], str]:
        async with VerifiersEnv("verifiers_arith", python=python, pythonpath=[HERE]) as env:
            right = await run_episode(env, "add-20-22", chat)
            wrong = await run_episode(env, 1, silent)
            with pytest.raises(VerifiersError) as e:
                await run_episode(env, "nope", silent)
            return right, wrong, env.bridge.tasks, str(e.value)

    right, wrong, tasks, missing = loop.run(play())
    assert [t["id"] for t in tasks] == ["add-20-22", "add-3-4"]
    assert right.messages[:2] == [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "What is 20 + 22? Use the add tool."},
    ]
    out = [m["content"] for m in right.messages if m["role"] == "tool"]
    assert "validation error" in out[0]
    assert "unknown tool 'sub'" in out[1]
    assert out[2] == "42"
    assert (right.metrics["tool_calls"], right.metrics["tool_errors"]) == (3, 2)
    assert right.scores == {"correct": 1.0, "used_tool": 1.0, "reward": 1.5}, right.info
    assert right.info["weights"] == {"correct": 1.0, "used_tool": 0.5}
    assert right.info["metrics"] == {"turns": 2.0}
    assert (right.info["task"], right.stopped) == ("add-20-22", "done")
    assert wrong.scores == {"correct": 0.0, "used_tool": 0.0, "reward": 0.0}
    assert wrong.info["task"] == "add-3-4"
    assert "has no task 'nope'; it has add-20-22, add-3-4" in missing
