"""OpenAI's Responses API on the TITO session server (``/sessions/{id}/v1/responses``), read
and written by the real ``openai`` client, against the embedded engine.

A Responses session and a chat-completions twin play the same conversation (instructions, a
tool, the model's function call, the tool's output, two more turns) with the same seeds: the
exported samples (ids, loss mask, logprobs, weight versions) are equal bit for bit. The
function-call turn is scripted (a tiny random model does not write tool calls): its text is
tokenized and returned as the engine's output, as ``miles.agentic.scripted`` does; every other
turn is the engine's. The engine runs without a prefix cache so the twin's turns are computed
exactly as the first ones were.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from chat_fixtures import CHATML

from miles_rollout import EngineConfig, FinishReason, GenerateOutput, LocalEngineClient
from miles_rollout.session import serve_sessions

openai = pytest.importorskip("openai")

CONTEXT = 1024
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'


class _ScriptedCalls:
    """An engine client whose first turn of each listed session is ``CALL`` (logprob 0, as
    a deterministic policy gives it); every other turn is the real engine's."""

    def __init__(self, inner: Any, tokenizer: Any) -> None:
        self._inner = inner
        self._tok = tokenizer
        self.scripted: set[str] = set()

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
    ) -> GenerateOutput:
        key = routing_key
        if key not in self.scripted:
            return await self._inner.generate(
                input_ids,
                sampling_params,
                return_logprob=return_logprob,
                rid=rid,
                routing_key=routing_key,
            )
        self.scripted.discard(key)
        end = self._tok.convert_tokens_to_ids("<|im_end|>")
        ids = [*self._tok.encode(CALL, add_special_tokens=False), end]
        version = await self._inner.get_weight_version()
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=[0.0] * len(ids),
            finish_reason=FinishReason(type="stop", matched=end),
            weight_version=version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            rid=str(key),
            output_weight_versions=[version] * len(ids),
        )


@pytest.fixture(scope="module")
def long_ctx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The conftest's tiny character-level Qwen3 with room for a tool schema in the prompt."""
    import torch
    from conftest import VOCAB, _tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        initializer_range=0.15,
    )
    path = tmp_path_factory.mktemp("responses") / "tiny-chat"
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok = _tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sessions(long_ctx_dir: Path) -> Iterator[tuple[Any, _ScriptedCalls]]:
    from transformers import AutoTokenizer

    eng = EngineConfig(model_path=str(long_ctx_dir), seed=0, enable_prefix_cache=False).build()
    tok = AutoTokenizer.from_pretrained(long_ctx_dir)
    client = _ScriptedCalls(LocalEngineClient(eng), tok)
    try:
        with serve_sessions(client, tokenizer=tok, model_name="tiny") as h:
            yield h, client
    finally:
        eng.shutdown()


def _call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _new(h: Any) -> str:
    status, out = _call("POST", f"{h.url}/sessions", {})
    assert status == 200, out
    return str(out["session_id"])


def _samples(h: Any, sid: str) -> list[dict[str, Any]]:
    status, out = _call("GET", f"{h.url}/sessions/{sid}/samples")
    assert status == 200, out
    return list(out["samples"])


def test_a_responses_conversation_is_the_chat_conversations_trajectory(sessions: Any) -> None:
    h, client = sessions
    rsid, csid = _new(h), _new(h)
    client.scripted |= {rsid, csid}
    responses = openai.OpenAI(base_url=h.session_url(rsid), api_key="unused").responses
    chat = openai.OpenAI(base_url=h.session_url(csid), api_key="unused").chat.completions
    chat_tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    items: list[Any] = [{"role": "user", "content": [{"type": "input_text", "text": "20 + 22?"}]}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Add with the tool."},
        {"role": "user", "content": "20 + 22?"},
    ]
    turns = []
    for seed, max_tokens, follow_up in ((1, 40, None), (5, 6, "Thanks."), (6, 40, None)):
        got = responses.create(
            model="tiny",
            instructions="Add with the tool.",
            input=items,
            tools=[ADD],
            max_output_tokens=max_tokens,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        ref = chat.create(
            model="tiny",
            messages=messages,
            tools=[chat_tool],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed,
        )
        choice = ref.choices[0]
        turns.append((got, choice.finish_reason))
        assert got.object == "response"
        assert got.model == "tiny"
        assert (got.usage.input_tokens, got.usage.output_tokens) == (
            ref.usage.prompt_tokens,
            ref.usage.completion_tokens,
        )
        assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
        items += [o.model_dump(exclude_none=True) for o in got.output]
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        for o in got.output:
            if o.type == "function_call":
                items.append({"type": "function_call_output", "call_id": o.call_id, "output": "42"})
        if follow_up:
            items.append({"role": "user", "content": follow_up})
            messages.append({"role": "user", "content": follow_up})
    # The scripted first turn: one function_call item, no message item (no text).
    first = turns[0][0]
    assert turns[0][1] == "tool_calls"
    assert [o.type for o in first.output] == ["function_call"]
    (fc,) = first.output
    assert (fc.name, json.loads(fc.arguments), fc.status) == (
        "add",
        {"a": 20, "b": 22},
        "completed",
    )
    assert fc.call_id.startswith("call_")
    assert first.status == "completed"
    assert first.incomplete_details is None
    assert first.tools[0].name == "add"
    assert first.instructions == "Add with the tool."
    # The engine's turns: one message item; cut by max_output_tokens <=> status incomplete.
    for got, finish in turns[1:]:
        assert [o.type for o in got.output] == ["message"]
        assert got.output[0].content[0].type == "output_text"
        cut = finish == "length"
        assert got.status == ("incomplete" if cut else "completed")
        assert (got.incomplete_details is not None) == cut
    assert turns[1][1] == "length"  # 6 tokens: this seed's reply is cut
    assert turns[1][0].incomplete_details.reason == "max_output_tokens"
    # The same trajectory, bit for bit; the tool output is prompt (mask 0).
    (a,), (b,) = _samples(h, rsid), _samples(h, csid)
    for key in ("tokens", "loss_mask", "rollout_logprobs", "weight_versions", "prompt_length"):
        assert a[key] == b[key], key
    assert a["num_turns"] == 3
    assert a["tools"] == b["tools"] == [chat_tool]
    assert [m["role"] for m in a["messages"]] == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant",
    ]  # fmt: skip
    assert sum(a["loss_mask"]) == sum(got.usage.output_tokens for got, _ in turns)
    n = a["prompt_length"]
    generated_end = n + turns[0][0].usage.output_tokens
    assert a["loss_mask"][: generated_end - n] == [1] * (generated_end - n)
    second_prompt = turns[1][0].usage.input_tokens
    assert a["loss_mask"][generated_end - n : second_prompt - n] == [0] * (
        second_prompt - generated_end
    )


def test_bad_responses_input_is_a_400_naming_the_field(sessions: Any) -> None:
    h, _ = sessions
    sid = _new(h)
    url = f"{h.session_url(sid)}/responses"
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    user = {"role": "user", "content": "hi"}
    for body, field in (
        ({"input": [user, {"type": "image_generation_call", "id": "x"}]}, "input[1].type"),
        ({"input": [user, {**call, "call_id": None}]}, "input[1].call_id"),
        ({"input": [user, {"type": "function_call_output", "output": "1"}]}, "input[1].call_id"),
        (
            {"input": [user, {"type": "function_call_output", "call_id": "c9", "output": "1"}]},
            "input[1].call_id 'c9' answers no function_call",
        ),
        ({"input": [user, {"role": "user", "content": [{"type": "input_image"}]}]}, "input[1]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "stream": True}, "stream"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"instructions": "x"}, "input is missing"),
    ):
        status, out = _call("POST", url, body)
        assert status == 400, (body, out)
        assert out["error"]["type"] == "invalid_request_error"
        assert field in out["error"]["message"], (field, out)
    # Over the context: the chat endpoint's code, so agent frameworks stop instead of retrying.
    status, out = _call("POST", url, {"input": "x" * CONTEXT})
    assert status == 400
    assert out["error"]["code"] == "context_length_exceeded"
    assert _call("GET", f"{h.url}/sessions/{sid}")[1]["num_turns"] == 0  # nothing committed
    status, out = _call("POST", f"{h.url}/sessions/nope/v1/responses", {"input": "hi"})
    assert status == 404


def test_input_items_map_onto_the_chat_messages_of_the_same_turns() -> None:
    """Reasoning, text and calls of one reply join one assistant message; each
    function_call_output is a tool message; developer is system; instructions lead."""
    from miles_rollout.session.responses import parse_responses_request

    text = [{"type": "output_text", "text": "Let me add.", "annotations": []}]
    thought = [{"type": "summary_text", "text": "Sum."}]
    reply = {"type": "message", "role": "assistant", "id": "m", "status": "completed"}
    req = parse_responses_request(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": "20 + 22?"},
                {"type": "reasoning", "id": "rs_1", "summary": thought},
                {**reply, "content": text},
                {"type": "function_call", "call_id": "a", "name": "add", "arguments": '{"a": 20}'},
                {"type": "function_call", "call_id": "b", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "42"},
                {"type": "function_call_output", "call_id": "b", "output": "0"},
                {"role": "assistant", "content": "42."},
            ],
            "tools": [ADD],
            "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 9,
            "include": ["message.output_text.logprobs"],
        }
    )  # fmt: skip
    call = lambda cid, args: {  # noqa: E731
        "id": cid, "type": "function", "function": {"name": "add", "arguments": args},
    }  # fmt: skip
    assert req.chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "20 + 22?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [call("a", '{"a": 20}'), call("b", "{}")],
            "reasoning_content": "Sum.",
        },
        {"role": "tool", "tool_call_id": "a", "content": "42"},
        {"role": "tool", "tool_call_id": "b", "content": "0"},
        {"role": "assistant", "content": "42."},
    ]
    assert req.chat.tools == [
        {"type": "function", "function": {k: ADD[k] for k in ADD if k != "type"}}
    ]
    assert req.chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert (req.chat.max_tokens, req.chat.logprobs) == (9, True)
    assert parse_responses_request({"input": "hi"}).chat.messages == [
        {"role": "user", "content": "hi"}
    ]
