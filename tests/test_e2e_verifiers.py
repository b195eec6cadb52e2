"""Verifiers' own rollout loop against a TITO session: its chat program, interception server
and MCP tool server (in Verifiers' Python, through miles_env's bridge) call the session
endpoint of the real session server over the embedded engine as they would call any provider;
the session keeps the token ids and the loss mask, Verifiers' rubric gives the named scores.

The model is a tiny random Llama with SmolLM2's tokenizer and ChatML template: what it says is
noise, so the test checks the path (what reached the session, what came back), not skill.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

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
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from miles_rollout import EngineConfig, serve
    from miles_rollout.models import smollm2_dir
    from miles_rollout.session import serve_sessions

    out = tmp_path_factory.mktemp("models") / "tiny-smol"
    tok = AutoTokenizer.from_pretrained(smollm2_dir(weights=False))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    engine = EngineConfig(model_path=str(out), max_running_requests=4, seed=0).build()
    try:
        with serve(engine) as http, serve_sessions(http.url, out) as h:
            yield SimpleNamespace(h=h, tokenizer=tok)
    finally:
        engine.shutdown()


def _call(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_verifiers_loop_through_a_tito_session(sessions: Any, tmp_path: Path) -> None:
    try:
        python = verifiers_python()
    except FileNotFoundError as e:
        pytest.skip(f"verifiers is not installed: run tools/setup_agent_frameworks.sh ({e})")
    (tmp_path / "sum_taskset.py").write_text(textwrap.dedent(TASKSET))
    h = sessions.h
    sid = _call("POST", f"{h.url}/sessions", {})["session_id"]
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
    samples = _call("GET", f"{h.url}/sessions/{sid}/samples")["samples"]
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
