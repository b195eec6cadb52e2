"""NeMo Gym both ways round, with nemo-gym 0.4.0 in its own Python (3.12) behind miles_env's
bridge, one process for the module:

- its own agent loop against a TITO session: NeMo Gym's ``simple_agent`` (``POST /run``:
  ``/seed_session``, its Responses loop, tools on the resources server, ``/verify``) with
  NeMo Gym's ``openai_model`` model server pointed at the session calls the session server's
  ``/v1/responses`` as it would call any provider; the session keeps the token ids and the
  loss mask, ``/verify``'s reward comes back (`NemoGymAgent`);
- Miles' episode driver as the agent on the same resources server (`NemoGymEnv`).

The resources server is the add task of miles-env's tests (``tests/frameworks/
nemo_gym_server.py``: a real ``SimpleResourcesServer``, served in the bridge). The model is a
tiny random Llama with SmolLM2's tokenizer and ChatML template; a tiny random model writes no
tool calls, so the turns named in a script are written as the model would write them
(tokenized and returned as the engine's output, as ``miles.agentic.scripted`` does) and the
others are the engine's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import REPO, call_json, save_tiny_smol

pytest.importorskip("miles_env")

from miles_env.environment import run_episode
from miles_env.integrations.nemo_gym import (
    NemoGymAgent,
    NemoGymBridge,
    NemoGymEnv,
    nemo_gym_python,
)
from miles_rollout.session import serve_sessions

SERVER = REPO / "packages" / "miles-env" / "tests" / "frameworks" / "nemo_gym_server.py"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "strict": False,
}
ROW = {
    "id": "add-20-22",
    "responses_create_params": {
        "input": [{"role": "user", "content": "What is 20 + 22? Use the add tool."}],
        "tools": [ADD],
    },
    "a": 20,
    "b": 22,
}


class _Scripted:
    """An engine client: a session's scripted turns (``scripts[session id]``, texts) are
    returned as generated (logprob 0), the rest are the engine's."""

    def __init__(self, inner: Any, tokenizer: Any) -> None:
        self._inner = inner
        self._tok = tokenizer
        self.scripts: dict[str, list[str]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Any:
        from miles_rollout import FinishReason, GenerateOutput

        script = self.scripts.get(str(routing_key))
        if not script:
            return await self._inner.generate(
                input_ids, sampling_params, return_logprob=return_logprob, routing_key=routing_key
            )
        end = self._tok.eos_token_id
        ids = [*self._tok.encode(script.pop(0), add_special_tokens=False), end]
        version = await self._inner.get_weight_version()
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[0.0] * len(ids),
            finish_reason=FinishReason(type="stop", matched=end),
            weight_version=version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            rid=str(routing_key),
            output_weight_versions=[version] * len(ids),
        )


@pytest.fixture(scope="module")
def nemo_gym() -> Iterator[Any]:
    """The bridge in NeMo Gym's Python (``.bridge``) and its event loop (``.run``); started
    first, so that NeMo Gym imports while the session fixture builds the engine."""
    try:
        python = nemo_gym_python()
    except FileNotFoundError as e:
        pytest.skip(f"nemo-gym is not installed: run tools/setup_agent_frameworks.sh ({e})")
    loop = asyncio.new_event_loop()
    bridge = NemoGymBridge(python)
    try:
        loop.run_until_complete(bridge.start())
        yield SimpleNamespace(run=loop.run_until_complete, bridge=bridge)
    finally:
        loop.run_until_complete(bridge.aclose())
        loop.close()


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from transformers import AutoTokenizer

    from miles_rollout import EngineConfig, LocalEngineClient

    model = save_tiny_smol(tmp_path_factory.mktemp("models") / "tiny-smol")
    engine = EngineConfig(model_path=str(model), max_running_requests=4, seed=0).build()
    tok = AutoTokenizer.from_pretrained(model)
    client = _Scripted(LocalEngineClient(engine), tok)
    try:
        with serve_sessions(client, tokenizer=tok) as h:
            yield SimpleNamespace(h=h, tokenizer=tok, client=client)
    finally:
        engine.shutdown()


def test_nemo_gym_loop_through_a_tito_session(nemo_gym: Any, sessions: Any) -> None:
    h, tok = sessions.h, sessions.tokenizer
    agent = NemoGymAgent(f"{SERVER}:AddServer", bridge=nemo_gym.bridge, max_turns=4)
    sample = SimpleNamespace(label="add-20-22", metadata={"nemo_gym": {"row": ROW}})
    request = {"max_tokens": 48, "temperature": 1.0, "top_k": 50}
    solved, noisy = (call_json("POST", f"{h.url}/sessions", {})["session_id"] for _ in "ab")
    sessions.client.scripts[solved] = [CALL, "The sum is 42."]
    sessions.client.scripts[noisy] = [CALL]  # then the engine's own reply

    async def play() -> tuple[dict[str, Any], dict[str, Any]]:
        return (
            await agent(h.session_url(solved), sample, request),
            await agent(h.session_url(noisy), sample, request),
        )

    run = nemo_gym.run
    with pytest.raises(ValueError, match="needs a task row"):
        run(agent("http://x", SimpleNamespace(label="x", metadata={}), {}))
    md, md2 = run(play())
    # NeMo Gym's loop: the call, the resources server's answer, the final message; /verify
    # paid for the tool's sum stated in the answer.
    assert [o["type"] for o in md["response"]["output"]] == [
        "function_call", "function_call_output", "message",
    ]  # fmt: skip
    assert json.loads(md["response"]["output"][1]["output"]) == {"sum": 42}
    assert (md["reward"], md["stopped"], md["task"]) == (1.0, "done", "add-20-22"), md
    assert md["metrics"]["agentic/turns"] == 2.0
    assert md["metrics"]["agentic/tool_calls"] == 1.0
    (s,) = call_json("GET", f"{h.url}/sessions/{solved}/samples")["samples"]
    # What NeMo Gym's agent sent, as the session stored it: the row's prompt and tool, the
    # call it made, the tool output it got, the reply.
    assert [m["role"] for m in s["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert s["messages"][0]["content"] == "What is 20 + 22? Use the add tool."
    assert s["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    assert json.loads(s["messages"][2]["content"]) == {"sum": 42}
    assert s["messages"][3]["content"] == "The sum is 42."
    assert [t["function"]["name"] for t in s["tools"]] == ["add"]
    # Generated ids trained (mask 1), the tool output between the turns masked out (0).
    n = s["prompt_length"]
    response, mask = s["tokens"][n:], s["loss_mask"]
    trained = tok.decode([t for t, m in zip(response, mask, strict=True) if m])
    masked = tok.decode([t for t, m in zip(response, mask, strict=True) if not m])
    assert trained == tok.decode(tok.encode(CALL + "<|im_end|>The sum is 42.<|im_end|>"))
    assert '{"sum":42}' in masked.replace(" ", "")
    assert "<tool_call>" not in masked
    assert sum(mask) == sum(len(tok.encode(t)) + 1 for t in (CALL, "The sum is 42."))
    # The second episode: the engine's own reply after the tool output, graded as it is.
    (s2,) = call_json("GET", f"{h.url}/sessions/{noisy}/samples")["samples"]
    reply = s2["messages"][-1]
    assert s2["messages"][2]["role"] == "tool"
    assert reply["role"] == "assistant"
    said = (reply.get("content") or "").strip()
    out2 = md2["response"]["output"]
    assert out2[-1]["type"] in ("message", "function_call_output")
    assert md2["reward"] == (1.0 if "42" in said else 0.0)
    assert md2["stopped"] == ("length" if s2["finish_reason"] == "length" else "done"), md2
    # A session whose context holds the call but not the tool output after it: NeMo Gym's
    # loop fails at the refused call; the episode is reward 0 with the reason, the call kept.
    with serve_sessions(sessions.client, tokenizer=tok, context_length=n + 40) as small:
        sid = call_json("POST", f"{small.url}/sessions", {})["session_id"]
        sessions.client.scripts[sid] = [CALL]
        md3 = run(agent(small.session_url(sid), sample, request))
        (s3,) = call_json("GET", f"{small.url}/sessions/{sid}/samples")["samples"]
    assert (md3["reward"], md3["stopped"]) == (0.0, "context_full"), md3
    assert f"maximum context length is {n + 40} tokens" in md3["reward_reason"]
    assert md3["reward_reason"].endswith(
        "over the engine's context length; start a new session or shorten it)"
    )
    assert s3["num_turns"] == 1
    assert sum(s3["loss_mask"]) == len(tok.encode(CALL)) + 1


def _call(cid: str, name: str, args: Any) -> dict[str, Any]:
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


def test_nemo_gym_resources_server_as_an_environment(nemo_gym: Any) -> None:
    """Miles plays the agent (a scripted chat) on the resources server: bad calls come back
    as tool errors, ``/verify`` pays 1.0 for the tool's sum stated, 0.0 for a wrong answer."""

    def agent(answer_with_sum: bool) -> Any:
        async def chat(
            messages: list[dict[str, Any]], tools: list[dict[str, Any]]
        ) -> dict[str, Any]:
            assert [t["function"]["name"] for t in tools] == ["add"]
            if messages[-1]["role"] == "user":
                calls = [
                    _call("c0", "add", {"a": "two"}),
                    _call("c1", "sub", {}),
                    _call("c2", "add", {"a": 20, "b": 22}),
                ]
                return {"role": "assistant", "content": "", "tool_calls": calls}
            total = json.loads(messages[-1]["content"])["sum"]
            return {
                "role": "assistant",
                "content": f"The sum is {total if answer_with_sum else 0}.",
            }

        return chat

    run = nemo_gym.run
    url = run(nemo_gym.bridge.serve_resources(f"{SERVER}:AddServer"))  # the agent test's server
    r = run(run_episode(NemoGymEnv(url), ROW, agent(True)))
    assert (r.reward, r.stopped) == (1.0, "done"), r.info
    out = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert "missing argument b" in out[0]
    assert "unknown tool 'sub'" in out[1]
    assert json.loads(out[2]) == {"sum": 42}
    assert (r.metrics["tool_calls"], r.metrics["tool_errors"]) == (3, 2)
    assert r.info["task"] == "add-20-22"
    wrong = run(run_episode(NemoGymEnv(url), ROW, agent(False)))
    assert wrong.reward == 0.0  # /verify read the final message
    with pytest.raises(ValueError, match="responses_create_params"):
        run(run_episode(NemoGymEnv(url), {"input": "hi"}, agent(True)))
