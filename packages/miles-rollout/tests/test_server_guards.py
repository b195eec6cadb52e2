"""API keys and bounds of the engine server and the TITO session server (issue 31).

Real servers over loopback; the engine is stalled for the bounds tests by parking its scheduler
thread on an event (a control call that does not return until the test says so), which is how
a stuck engine looks from outside.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from chat_fixtures import with_chat_template
from engine_faults import barrier, stalled, wait_until

from miles_rollout import Engine, SGLangClient, serve
from miles_rollout.auth import check_bind, resolve_api_key
from miles_rollout.session import serve_sessions

KEY = "test-key-1"


def call(
    method: str,
    url: str,
    body: Any = None,
    *,
    key: str | None = None,
    raw: bytes | None = None,
    timeout: float = 120.0,
) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read()
            return resp.status, dict(resp.headers), json.loads(text) if text.strip() else None
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, dict(exc.headers), json.loads(text) if text.strip() else None


GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def forged_length(url: str, *, key: str | None = None) -> tuple[int, str | None, Any]:
    """POST announcing a 1 GiB body but sending two bytes, over a real socket.

    A server that waits for the announced body never answers (the read times out and the test
    fails); one that refuses on the header answers 413 with the two bytes sent.
    """
    headers = {"Content-Length": str(1 << 30)}
    return _post_raw(url, headers, b"{}", key=key)


def _post_raw(
    url: str, headers: dict[str, str], body: Any, *, key: str | None = None, chunked: bool = False
) -> tuple[int, str | None, Any]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=120)
    headers = {"Content-Type": "application/json", **headers}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        if chunked:  # no Content-Length: Transfer-Encoding: chunked
            conn.request("POST", parts.path, body=body, headers=headers, encode_chunked=True)
        else:
            conn.putrequest("POST", parts.path)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Connection"), json.loads(resp.read())
    finally:
        conn.close()


def test_engine_server_demands_the_key_on_every_control_endpoint(fresh_engine: Engine) -> None:
    with serve(fresh_engine, api_key=KEY) as h:
        # The liveness probe (what sglang-router polls) stays open and says nothing else.
        assert call("GET", h.url + "/health")[0] == 200
        controls = [
            ("POST", "/generate", GEN),
            ("GET", "/health_generate", None),
            ("GET", "/get_server_info", None),
            ("GET", "/metrics", None),
            ("POST", "/pause_generation", {"mode": "abort"}),
            ("POST", "/update_weight_version", {"new_version": "evil"}),
            ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
            ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
            ("POST", "/abort_request", {"abort_all": True}),
            ("POST", "/flush_cache", None),
        ]
        for method, path, body in controls:
            for key in (None, "wrong-key", KEY + "x", ""):
                status, headers, out = call(method, h.url + path, body, key=key)
                assert status == 401, (path, key, status, out)
                assert out["error"]["code"] == 401
                assert "Authorization: Bearer" in out["error"]["message"]
                assert headers["WWW-Authenticate"].startswith("Bearer")
        # Nothing was applied: same version, not paused, a generation still runs.
        assert fresh_engine.weight_version == "0"
        assert not any(s["paused"] for s in fresh_engine.server_info()["internal_states"])
        status, _, out = call("POST", h.url + "/generate", GEN, key=KEY)
        assert status == 200
        assert len(out["output_ids"]) == 2
        status, _, out = call(
            "POST", h.url + "/update_weight_version", {"new_version": "7"}, key=KEY
        )
        assert (status, fresh_engine.weight_version) == (200, "7")


def test_the_key_is_checked_before_the_body_is_read(fresh_engine: Engine) -> None:
    with serve(fresh_engine, api_key=KEY, max_request_mb=1) as h:
        big = b"x" * (2 << 20)
        assert call("POST", h.url + "/generate", raw=big)[0] == 401
        status, _, out = call("POST", h.url + "/generate", raw=big, key=KEY)
        assert status == 413
        assert "--max-request-mb" in out["error"]["message"]
        # Without a length (chunked) the cap applies while the body streams in.
        chunks = iter([b"{", b" " * (1 << 20), b"}"])
        status, connection, out = _post_raw(h.url + "/generate", {}, chunks, key=KEY, chunked=True)
        assert (status, connection) == (413, "close"), out
        assert call("POST", h.url + "/generate", GEN, key=KEY)[0] == 200


def test_an_announced_oversized_body_is_refused_before_it_is_read(fresh_engine: Engine) -> None:
    with serve(fresh_engine, api_key=KEY) as h:
        for _ in range(2):  # refused twice: the first refusal left the server serving
            status, connection, out = forged_length(h.url + "/generate", key=KEY)
            assert status == 413, out
            assert connection == "close"
            assert "--max-request-mb" in out["error"]["message"]
            assert str(64 << 20) in out["error"]["message"]
        assert forged_length(h.url + "/generate")[0] == 401  # the key still comes first
        status, _, out = call("POST", h.url + "/generate", GEN, key=KEY)
        assert status == 200
        assert len(out["output_ids"]) == 2


async def _client_generate(url: str, key: str | None) -> list[int]:
    async with SGLangClient(url, api_key=key) as c:
        out = await c.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0})
        return out.output_ids


def test_the_client_sends_the_key(engine: Engine) -> None:
    import asyncio

    from miles_rollout import SGLangHTTPError

    with serve(engine, api_key=KEY) as h:
        assert len(asyncio.run(_client_generate(h.url, KEY))) == 2
        with pytest.raises(SGLangHTTPError) as info:
            asyncio.run(_client_generate(h.url, None))
        assert info.value.status == 401


def test_non_loopback_without_a_key_refuses_to_start(engine: Engine) -> None:
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.org"):
        with pytest.raises(ValueError, match="--insecure-no-auth"):
            check_bind(host, None, insecure_no_auth=False, what="x")
        check_bind(host, "k", insecure_no_auth=False, what="x")
        check_bind(host, None, insecure_no_auth=True, what="x")
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_bind(host, None, insecure_no_auth=False, what="x")
    with pytest.raises(ValueError, match="without an API key"):
        serve(engine, host="0.0.0.0")  # refused before anything binds
    with pytest.raises(ValueError, match="without an API key"):
        serve_sessions("http://127.0.0.1:1", host="0.0.0.0", tokenizer=object())


def test_api_key_from_the_environment() -> None:
    assert resolve_api_key(None, env={}) is None
    assert resolve_api_key(None, env={"MILES_API_KEY": "abc"}) == "abc"
    assert resolve_api_key("flag", env={"MILES_API_KEY": "abc"}) == "flag"
    assert resolve_api_key(None, env={"MILES_API_KEY": ""}) is None
    for bad in ("", "two words", "caf\u00e9", "tab\tkey"):
        with pytest.raises(ValueError, match="printable ASCII"):
            resolve_api_key(bad, env={})


def _generated(engine: Engine) -> int:
    return sum(s["num_generated_tokens"] for s in engine.server_info()["internal_states"])


def test_full_queue_answers_503_with_retry_after(fresh_engine: Engine) -> None:
    running = fresh_engine.config.max_running_requests
    with serve(fresh_engine, max_queued_requests=2) as h:
        result: list[Any] = []
        batch = {**GEN, "input_ids": [[5, 6, 7 + i] for i in range(running + 2)]}
        with stalled(fresh_engine):
            t = threading.Thread(
                target=lambda: result.append(call("POST", h.url + "/generate", batch))
            )
            t.start()
            # The batch is in: every slot (running + queued) is taken.
            deadline_ok = wait_until(lambda: fresh_engine.load()[0]["num_reqs"] == running + 2)
            assert deadline_ok
            status, headers, out = call("POST", h.url + "/generate", GEN)
            assert status == 503
            assert headers["Retry-After"] == "1"
            assert "--max-queued-requests" in out["error"]["message"]
            assert call("GET", h.url + "/health_generate")[0] == 503
        t.join(120)
        assert result[0][0] == 200
        assert len(result[0][2]) == running + 2
        assert call("POST", h.url + "/generate", GEN)[0] == 200  # room again


def test_timed_out_probe_leaves_the_queue(fresh_engine: Engine) -> None:
    with serve(fresh_engine, health_generate_timeout_s=0.2) as h:
        before = _generated(fresh_engine)
        with stalled(fresh_engine):
            assert call("GET", h.url + "/health_generate")[0] == 503
            # Cancelled at once: nothing counts as in flight any more.
            assert fresh_engine.load()[0]["num_reqs"] == 0
        barrier(fresh_engine)
        states = fresh_engine.server_info()["internal_states"]
        assert all(s["num_waiting_reqs"] == 0 and s["num_running_reqs"] == 0 for s in states)
        assert _generated(fresh_engine) == before  # the probe never ran
        assert call("GET", h.url + "/health_generate")[0] == 200


def test_a_client_that_leaves_takes_its_request_out(fresh_engine: Engine) -> None:
    with serve(fresh_engine) as h:
        before = _generated(fresh_engine)
        with stalled(fresh_engine):
            with pytest.raises(TimeoutError):  # urllib gives up and hangs up
                call("POST", h.url + "/generate", GEN, timeout=0.5)
            assert wait_until(lambda: fresh_engine.load()[0]["num_reqs"] == 0)
        barrier(fresh_engine)
        assert _generated(fresh_engine) == before


@pytest.fixture(scope="module")
def chat_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(model_dir, tmp_path_factory.mktemp("chat") / "tiny-chat")


def test_session_server_demands_its_key_and_sends_the_engine_key(
    chat_dir: Path, fresh_engine: Engine
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    turn = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve(fresh_engine, api_key=KEY) as engine_http:
        with serve_sessions(
            engine_http.url, tokenizer=tok, api_key="sess-key", engine_api_key=KEY
        ) as h:
            assert call("GET", h.url + "/health")[0] == 200
            for path in ("/sessions", "/v1/models"):
                method = "POST" if path == "/sessions" else "GET"
                assert call(method, h.url + path, {})[0] == 401
                assert call(method, h.url + path, {}, key=KEY)[0] == 401  # not the engine's
            status, _, out = call("POST", h.url + "/sessions", {}, key="sess-key")
            assert status == 200
            sid = out["session_id"]
            url = h.session_url(sid) + "/chat/completions"
            assert call("POST", url, turn)[0] == 401
            status, _, out = call("POST", url, turn, key="sess-key")
            assert status == 200, out
        # A session server with the wrong engine key: the engine refuses every turn (502) and
        # the session keeps nothing.
        with serve_sessions(
            engine_http.url, tokenizer=tok, api_key="s", engine_api_key="wrong"
        ) as h:
            sid = call("POST", h.url + "/sessions", {}, key="s")[2]["session_id"]
            status, _, out = call("POST", h.session_url(sid) + "/chat/completions", turn, key="s")
            assert status == 502
            assert "401" in out["error"]["message"]
            status, _, out = call("GET", f"{h.url}/sessions/{sid}/samples", key="s")
            assert out["samples"] == []


def test_session_server_bounds(chat_dir: Path, fresh_engine: Engine) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    turn = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with (
        serve(fresh_engine) as engine_http,
        serve_sessions(engine_http.url, tokenizer=tok, max_request_mb=1, max_pending_turns=1) as h,
    ):
        sid = call("POST", h.url + "/sessions", {})[2]["session_id"]
        url = h.session_url(sid) + "/chat/completions"
        status, _, out = call("POST", url, raw=b"{" + b" " * (2 << 20) + b"}")
        assert status == 413, out
        status, connection, out = forged_length(url)
        assert (status, connection) == (413, "close"), out
        assert "--max-request-mb" in out["error"]["message"]
        result: list[Any] = []
        with stalled(fresh_engine):
            t = threading.Thread(target=lambda: result.append(call("POST", url, turn)))
            t.start()
            assert wait_until(lambda: fresh_engine.load()[0]["num_reqs"] == 1)
            sid2 = call("POST", h.url + "/sessions", {})[2]["session_id"]
            status, headers, out = call("POST", h.session_url(sid2) + "/chat/completions", turn)
            assert status == 503
            assert headers["Retry-After"] == "1"
        t.join(120)
        assert result[0][0] == 200
