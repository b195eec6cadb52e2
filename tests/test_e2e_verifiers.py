"""Verifiers' own rollout loop against a TITO session: its chat program, interception server
and MCP tool server (in Verifiers' Python, through miles_env's bridge) call the session
endpoint of the real session server over the embedded engine as they would call any provider;
the session keeps the token ids and the loss mask, Verifiers' rubric gives the named scores.
The same through ``miles train`` (``task.name: verifiers``, ``rollout.agent:
miles_env.integrations.verifiers:verifiers_agent``), two steps.

The model is a tiny random Llama with SmolLM2's tokenizer and ChatML template: what it says is
noise, so the test checks the path (what reached the session, what came back), not skill.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import call_json, save_tiny_smol, tito_sessions

pytest.importorskip("miles_env")

from miles_env.integrations.verifiers import VerifiersAgent, verifiers_python

TASKSET = '''
import verifiers.v1 as vf


class Calc(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]

    @vf.reward(weight=2.0)
    async def correct(self, task, trace) -> float:
        return 1.0 if str(task.answer) in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return 1.0 if len(trace.last_reply) < 400 else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        yield SumTask(SumData(id="add-3-4", prompt="What is 3 + 4? Use the add tool.", answer=7))


__all__ = ["SumTaskset"]

if __name__ == "__main__":
    Calc.run()
'''


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_smol(tmp_path_factory.mktemp("models") / "tiny-smol")


@pytest.fixture(scope="module")
def sessions(tiny_smol: Path) -> Iterator[Any]:
    with tito_sessions(tiny_smol) as s:
        yield s


@pytest.mark.slow
def test_verifiers_loop_through_a_tito_session(sessions: Any, tmp_path: Path) -> None:
    try:
        python = verifiers_python()
    except FileNotFoundError as e:
        pytest.skip(f"verifiers is not installed: run tools/setup_agent_frameworks.sh ({e})")
    (tmp_path / "sum_taskset.py").write_text(textwrap.dedent(TASKSET))
    h = sessions.h
    sid = call_json("POST", f"{h.url}/sessions", {})["session_id"]
    agent = VerifiersAgent("sum_taskset", python=python, pythonpath=[tmp_path], max_turns=2)
    sample = SimpleNamespace(label="add-3-4", metadata={})

    async def play() -> dict[str, Any]:
        try:
            return await agent(h.session_url(sid), sample, {"max_tokens": 12, "temperature": 1.0})
        finally:
            await agent.aclose()

    md = asyncio.run(play())
    assert md["verifier_error"] is None, md
    assert md["task"] == "add-3-4"
    assert set(md["scores"]) == {"correct", "brief", "reward"}
    assert md["scores"]["reward"] == 2.0 * md["scores"]["correct"] + 0.5 * md["scores"]["brief"]
    assert md["metrics"]["agentic/turns"] == 1.0
    samples = call_json("GET", f"{h.url}/sessions/{sid}/samples")["samples"]
    assert len(samples) == 1
    s = samples[0]
    # What Verifiers' chat program sent: the task's prompt and its MCP toolset's tool.
    assert s["messages"][0] == {"role": "user", "content": "What is 3 + 4? Use the add tool."}
    assert [t["function"]["name"] for t in s["tools"]] == ["add"]
    assert s["tools"][0]["function"]["parameters"]["required"] == ["a", "b"]
    # The session's tokens: generated ids exactly where the loss mask is 1, at most max_tokens
    # of them (plus the end-of-turn join), the prompt being what the template renders.
    n_prompt, n_resp = s["prompt_length"], s["response_length"]
    assert len(s["tokens"]) == n_prompt + n_resp
    assert len(s["loss_mask"]) == n_resp
    assert 1 <= sum(s["loss_mask"]) <= 12
    prompt_text = sessions.tokenizer.decode(s["tokens"][:n_prompt])
    assert "What is 3 + 4? Use the add tool." in prompt_text
    assert '"name": "add"' in prompt_text
    generated = [t for t, m in zip(s["tokens"][n_prompt:], s["loss_mask"], strict=True) if m]
    reply = sessions.tokenizer.decode(generated, skip_special_tokens=True)
    assert s["messages"][-1]["role"] == "assistant"
    assert reply.strip() == (s["messages"][-1]["content"] or "").strip()


FRAMEWORKS = Path(__file__).resolve().parents[1] / "packages" / "miles-env" / "tests" / "frameworks"


def test_the_verifiers_task_set(tmp_path: Path) -> None:
    """``task.name: verifiers`` builds a `VerifiersTaskSet`: the taskset's tasks (listed by the
    bridge in Verifiers' Python) as prompts in a seeded order, each with what the agent
    needs; no Verifiers Python is one clear ValueError (one bridge start: about 10 s, most of
    it importing Verifiers)."""
    from miles.agentic import VerifiersTaskSet
    from miles.config import TaskSettings
    from miles.tasks import make_task

    with pytest.raises(ValueError, match=r"setup_agent_frameworks\.sh"):
        make_task(TaskSettings(name="verifiers", params={"taskset": "x", "python": "/nope/py"}))
    try:
        verifiers_python()
    except FileNotFoundError as e:
        pytest.skip(f"verifiers is not installed: run tools/setup_agent_frameworks.sh ({e})")
    params = {"taskset": "verifiers_arith", "pythonpath": [str(FRAMEWORKS)], "max_turns": 3}
    task = make_task(TaskSettings(name="verifiers", params=params))
    assert isinstance(task, VerifiersTaskSet)
    assert task.names == ["add-20-22", "add-3-4"]
    items = task.sample(4)
    assert sorted(i.label for i in items[:2]) == sorted(i.label for i in items[2:]) == task.names
    item = next(i for i in items if i.label == "add-3-4")
    assert item.messages == [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "What is 3 + 4? Use the add tool."},
    ]
    assert item.metadata["max_turns"] == 3
    assert item.metadata["verifiers"]["taskset"] == "verifiers_arith"
    assert item.metadata["verifiers"]["pythonpath"] == [str(FRAMEWORKS)]
    with pytest.raises(ValueError, match="episode_reward"):
        task.reward("7", "add-3-4")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_miles_train_runs_a_verifiers_taskset(tiny_smol: Path, tmp_path: Path) -> None:
    """``miles train`` (the real CLI) with ``task.name: verifiers`` (the two-task taskset of
    miles-env's tests) and ``rollout.agent: miles_env.integrations.verifiers:verifiers_agent``:
    two steps, each episode Verifiers' own loop through the run's TITO session server, the
    rubric's reward on each sample, the samples trained with their masks."""
    try:
        verifiers_python()
    except FileNotFoundError as e:
        pytest.skip(f"verifiers is not installed: run tools/setup_agent_frameworks.sh ({e})")
    recipe = tmp_path / "verifiers_e2e.py"
    recipe.write_text(
        textwrap.dedent(
            f"""
            def recipe():
                return {{
                    "name": "verifiers-e2e",
                    "model_path": {str(tiny_smol)!r},
                    "engine": {{"dtype": "float32", "max_running_requests": 8}},
                    "sampling": {{"temperature": 1.0, "max_new_tokens": 12}},
                    "trainer": {{"lr": 1e-4, "dtype": "float32", "micro_batch_size": 4}},
                    "rollout": {{
                        "prompts_per_step": 1,
                        "n_samples_per_prompt": 2,
                        "generate_fn": "multi_turn",
                        "agent": "miles_env.integrations.verifiers:verifiers_agent",
                    }},
                    "task": {{
                        "name": "verifiers",
                        "params": {{
                            "taskset": "verifiers_arith",
                            "pythonpath": [{str(FRAMEWORKS)!r}],
                            "max_turns": 2,
                        }},
                        "reward_fn": "miles_env.rollout:episode_reward",
                    }},
                    "run": {{"num_steps": 2}},
                }}
            """
        )
    )
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    args = ["train", str(recipe), "--out", str(run), "--no-progress"]
    args += ["--set", "run.dump_samples=true"]
    proc = subprocess.run(
        [sys.executable, "-m", "miles", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/failed_frac"] == 0.0, r
        assert r["train/loss"] == r["train/loss"], r  # trained (finite)
        assert r["rollout/agentic/turns"] >= 1.0, r
        by_task = [k for k in r if k.startswith("rollout/agentic/reward/add-")]
        assert by_task, r
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_smol)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        # The rubric's weighted total: correct (weight 1) + used_tool (weight 0.5).
        assert s["reward"] in (0.0, 0.5, 1.0, 1.5), s["reward"]
        tokens, mask = s["tokens"], s["loss_mask"]
        first = mask.index(1)
        text = tok.decode(tokens[: len(tokens) - len(mask) + first])
        # What Verifiers' chat program sent first: the task's system prompt, its prompt and
        # its toolset's tool; generated ids trained, everything else masked.
        assert "You are a careful calculator." in text
        assert "Use the add tool." in text
        assert '"name": "add"' in text
        assert all((v is None) == (m == 0) for v, m in zip(s["weight_versions"], mask))
