"""HUD's own agent loop against a TITO session: HUD's ``OpenAIChatAgent`` and its episode
driver (``hud.eval.run.rollout``, the environment template served on loopback by HUD's
``LocalRuntime``), in HUD's Python through miles_env's bridge, call the session endpoint of
the real session server over the embedded engine as they would call any provider; the
session keeps the token ids and the loss mask, HUD's grade comes back as the reward.

The model is a tiny random Llama with SmolLM2's tokenizer and ChatML template: what it says is
noise, so the test checks the path (what reached the session, what HUD graded, what came
back), not skill.
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import call_json, save_tiny_smol, tito_sessions

pytest.importorskip("miles_env")

from miles_env.integrations.hud import HudAgent, HudError, hud_python

# The grade carries the answer HUD's driver sent, so the test can tell HUD graded exactly the
# reply the session generated.
ENV = """
import hud

env = hud.Environment("arith")


@env.template(id="add", description="Add two integers.")
async def add(a: int, b: int):
    answer = yield f"What is {a} + {b}? Answer with the number only."
    text = str(answer)
    right = str(a + b) in text
    yield {
        "score": 1.0 if right else 0.0,
        "content": "right" if right else f"expected {a + b}",
        "info": {"answer": text},
    }


@env.template(id="speak")
async def speak():
    answer = yield "Say something."
    yield 1.0 if str(answer).strip() else 0.0
"""


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_smol(tmp_path_factory.mktemp("models") / "tiny-smol")


@pytest.fixture(scope="module")
def sessions(tiny_smol: Path) -> Iterator[Any]:
    with tito_sessions(tiny_smol) as s:
        yield s


@pytest.mark.slow
def test_hud_loop_through_a_tito_session(sessions: Any, tmp_path: Path) -> None:
    try:
        python = hud_python()
    except FileNotFoundError as e:
        pytest.skip(f"hud is not installed: run tools/setup_agent_frameworks.sh ({e})")
    source = tmp_path / "arith_env.py"
    source.write_text(textwrap.dedent(ENV))
    h = sessions.h
    sid = call_json("POST", f"{h.url}/sessions", {})["session_id"]
    agent = HudAgent(source, python=python, max_turns=2)
    sample = SimpleNamespace(label="add", metadata={"hud": {"args": {"a": 3, "b": 4}}})
    request = {"max_tokens": 12, "temperature": 1.0, "top_k": 50}

    sid2 = call_json("POST", f"{h.url}/sessions", {})["session_id"]

    async def play() -> tuple[dict[str, Any], dict[str, Any], str]:
        try:
            md = await agent(h.session_url(sid), sample, request)
            # Any reply is right here: a grade of 1 (a bare number) comes back as well.
            md2 = await agent(h.session_url(sid2), SimpleNamespace(label="speak"), request)
            # A template the environment does not have: HUD's bridge names the ones it has.
            with pytest.raises(HudError) as bad:
                await agent(h.session_url(sid), SimpleNamespace(label="nope", metadata={}), {})
            return md, md2, str(bad.value)
        finally:
            await agent.aclose()

    with pytest.raises(ValueError, match="needs a HUD environment"):
        asyncio.run(HudAgent(python=python)("http://x", SimpleNamespace(label="add"), {}))
    md, md2, bad = asyncio.run(play())
    assert bad == "ValueError: HUD environment 'arith' has no template 'nope'; it has add, speak"
    assert md["task"] == "add"
    assert md["verifier_error"] is None, md
    assert md["notes"] == [], md
    assert md["metrics"]["agentic/turns"] == 1.0
    assert md["stopped"] in ("done", "length"), md
    samples = call_json("GET", f"{h.url}/sessions/{sid}/samples")["samples"]
    assert len(samples) == 1  # the unknown template never reached the model
    s = samples[0]
    # What HUD's agent sent: the template's prompt (as HUD's text parts), no tools.
    first = s["messages"][0]
    assert first["role"] == "user"
    text = first["content"] if isinstance(first["content"], str) else first["content"][0]["text"]
    assert text == "What is 3 + 4? Answer with the number only."
    assert not s.get("tools")
    # The session's tokens: generated ids exactly where the loss mask is 1.
    n_prompt, n_resp = s["prompt_length"], s["response_length"]
    assert len(s["tokens"]) == n_prompt + n_resp
    assert len(s["loss_mask"]) == n_resp
    assert 1 <= sum(s["loss_mask"]) <= 12
    assert "What is 3 + 4? Answer with the number only." in sessions.tokenizer.decode(
        s["tokens"][:n_prompt]
    )
    generated = [t for t, m in zip(s["tokens"][n_prompt:], s["loss_mask"], strict=True) if m]
    reply = sessions.tokenizer.decode(generated, skip_special_tokens=True)
    assert s["messages"][-1]["role"] == "assistant"
    assert reply.strip() == (s["messages"][-1]["content"] or "").strip()
    # HUD graded exactly the session's reply, and its grade is the reward.
    assert md["grade"]["info"]["answer"] == s["messages"][-1]["content"]
    right = "7" in md["grade"]["info"]["answer"]
    assert md["reward"] == md["scores"]["reward"] == (1.0 if right else 0.0)
    assert md["grade"]["content"] == ("right" if right else "expected 7")
    reason = "right" if right else "expected 7"
    assert md["reward_reason"] == f"HUD grade {md['reward']:g} for template 'add': {reason}"
    # The second episode: HUD's number grade for a non-empty reply.
    spoken = call_json("GET", f"{h.url}/sessions/{sid2}/samples")["samples"][-1]["messages"]
    assert spoken[0]["content"] in ("Say something.", [{"type": "text", "text": "Say something."}])
    assert spoken[-1]["content"].strip(), spoken  # 12 tokens of noise are not empty
    assert (md2["reward"], md2["verifier_error"]) == (1.0, None), md2
    assert md2["reward_reason"] == "HUD grade 1 for template 'speak'"
