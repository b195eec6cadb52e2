"""The HTTP server's wire shapes (SGLang's field names), robustness, and client HTTP details."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from miles_rollout import Engine, SamplingParams, SGLangClient, SGLangHTTPError, serve
from miles_rollout.server import ServerHandle
from miles_transfer import HTTPReceiver, tensor_digest


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerHandle]:
    handle = serve(engine)
    yield handle
    handle.close()


def _call(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async def main() -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, url, json=body, data=raw) as resp,
        ):
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    return asyncio.run(main())


def test_generate_response_has_sglang_shape(server: ServerHandle) -> None:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "rid": "abc",
    }
    status, resp = _call("POST", server.url + "/generate", body)
    assert status == 200
    assert set(resp) == {"text", "output_ids", "meta_info"}
    meta = resp["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == 4
    assert meta["weight_version"] == "0"
    assert meta["output_token_weight_versions"] == ["0"] * 4  # a Miles extension
    assert meta["cached_tokens"] == 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == resp["output_ids"]
    assert all(t[2] is None and isinstance(t[0], float) for t in triples)
    # Without return_logprob (SGLang's default is False) there are no logprobs.
    status, resp = _call("POST", server.url + "/generate", {"input_ids": [5, 6]})
    assert status == 200
    assert "output_token_logprobs" not in resp["meta_info"]


def test_generate_batch_text_and_neutral_fields(server: ServerHandle, engine: Engine) -> None:
    body = {
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "sampling_seed": 4}],
        "rid": "batch",
        "return_logprob": [True, False],
        # Fields a router may add with their neutral values are accepted.
        "stream": False,
        "logprob_start_len": -1,
        "return_hidden_states": False,
        "data_parallel_rank": 0,
    }
    status, resp = _call("POST", server.url + "/generate", body)
    assert status == 200, resp
    assert [r["meta_info"]["id"] for r in resp] == ["batch_0", "batch_1"]
    assert [r["meta_info"]["completion_tokens"] for r in resp] == [2, 3]
    assert "output_token_logprobs" in resp[0]["meta_info"]
    assert "output_token_logprobs" not in resp[1]["meta_info"]
    status, resp = _call(
        "POST",
        server.url + "/generate",
        {
            "text": "hello",
            "sampling_params": {"max_new_tokens": 2, "frequency_penalty": 0.0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    )
    assert status == 200, resp
    assert resp["meta_info"]["prompt_tokens"] == 5
    assert all(isinstance(t[2], str) for t in resp["meta_info"]["output_token_logprobs"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1] * 200}, r"200 tokens.*context length \(128 tokens\)"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown sampling_params keys"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "return_routed_experts": True}, "return_routed_experts"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": []}, "empty"),
        ({}, "exactly one of input_ids and text"),
        ({"input_ids": [1], "sampling_params": [{}, {}]}, "2 entries for 1 prompts"),
    ],
)
def test_bad_generate_is_400_with_message(server: ServerHandle, body: Any, message: str) -> None:
    status, resp = _call("POST", server.url + "/generate", body)
    assert status == 400
    assert resp["error"]["message"]
    import re

    assert re.search(message, resp["error"]["message"]), resp


def test_other_endpoints_and_errors_are_json(server: ServerHandle) -> None:
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        status, resp = _call("GET", server.url + path)
        assert status == 200
        assert Path(resp["model_path"]).is_dir()
    status, resp = _call("GET", server.url + "/get_load")
    assert status == 200
    assert resp[0]["dp_rank"] == 0
    assert _call("GET", server.url + "/health_generate")[0] == 200
    assert _call("GET", server.url + "/get_weight_version") == (200, {"weight_version": "0"})
    status, resp = _call("POST", server.url + "/generate", raw=b"{not json")
    assert status == 400
    assert "not valid JSON" in resp["error"]["message"]
    status, resp = _call("GET", server.url + "/no_such_endpoint")
    assert status == 404
    assert "error" in resp
    status, resp = _call("POST", server.url + "/pause_generation", {"mode": "x", "extra": 1})
    assert status == 400
    assert "unknown fields" in resp["error"]["message"]


def test_junk_and_http2_probes_do_not_kill_the_server(server: ServerHandle) -> None:
    probes = [
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),
        os.urandom(512),
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    ]
    for probe in probes:
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            s.sendall(probe)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                s.recv(1024)
    status, _resp = _call("GET", server.url + "/get_model_info")
    assert status == 200


def test_client_disconnect_drops_the_request(server: ServerHandle, engine: Engine) -> None:
    async def main() -> None:
        timeout = aiohttp.ClientTimeout(total=0.3)
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(server.url + "/generate", json=body) as resp:
                    await resp.read()

    # Paused, the request waits in the queue until its client gives up.
    engine.pause_generation("in_place")
    try:
        asyncio.run(main())
        state = engine.server_info()["internal_states"][0]
        assert state["num_waiting_reqs"] == 1
        generated = state["num_generated_tokens"]
    finally:
        engine.continue_generation()
    deadline = time.monotonic() + 10
    while True:
        state = engine.server_info()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.01)
    assert state["num_generated_tokens"] == generated, "the abandoned request still ran"


def test_miles_transfer_http_receiver_round_trip(model_dir: Path) -> None:
    from miles_rollout import EngineConfig

    with EngineConfig(model_path=str(model_dir)).build() as eng, serve(eng) as handle:
        receiver = HTTPReceiver(handle.url)
        assert receiver.dtype == torch.float32
        assert receiver.tp_size == 1
        new = {"model.norm.weight": torch.randn(64), "lm_head.weight": torch.randn(128, 64)}
        receiver.update_weights_from_tensor(new.items(), weight_version="5")
        assert receiver.weights_checksum(list(new)) == {n: tensor_digest(t) for n, t in new.items()}
        assert eng.weight_version == "5"


def test_routing_key_api_key_and_missing_checksum_endpoint() -> None:
    """Against a bare aiohttp app standing in for a stock SGLang worker: the client's headers."""
    seen: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body = await request.json()
        assert body["sampling_params"] == {"max_new_tokens": 1, "sampling_seed": 3}
        return web.json_response(
            {
                "text": "a",
                "output_ids": [7],
                "meta_info": {
                    "id": "q",
                    "finish_reason": {"type": "length", "length": 1},
                    "prompt_tokens": 2,
                    "completion_tokens": 1,
                    "weight_version": "w",
                    "output_token_logprobs": [[-0.5, 7, None]],
                },
            }
        )

    async def update_weight_version(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"success": True, "message": "ok"})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/update_weight_version", update_weight_version)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with SGLangClient(f"http://127.0.0.1:{port}", api_key="k") as c:
                out = await c.generate(
                    [1, 2], SamplingParams(max_new_tokens=1, seed=3), routing_key="sess-1"
                )
                assert out.output_ids == [7]
                assert out.output_logprobs == [-0.5]
                assert out.weight_version == "w"
                # No per-token versions from a stock server: the request's version per token.
                assert out.output_weight_versions == ["w"]
                assert out.cached_tokens == 0
                with pytest.raises(SGLangHTTPError, match="not a miles-rollout server"):
                    await c.weights_checksum()
                # SGLang aborts every request on a version update unless told not to: the
                # client always says so.
                await c.update_weight_version("v2")
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert seen[0]["X-SMG-Routing-Key"] == "sess-1"
    assert seen[0]["Authorization"] == "Bearer k"
    assert seen[1] == {"new_version": "v2", "abort_all_requests": False}


def test_client_retries_idempotent_calls_only() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed

    async def main() -> None:
        async with SGLangClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.1) as c:
            assert await c.health() is False
            start = time.monotonic()
            with pytest.raises(aiohttp.ClientConnectionError):
                await c.get_server_info()
            assert time.monotonic() - start >= 0.3  # two retries: 0.1 + 0.2 s of backoff
            start = time.monotonic()
            with pytest.raises(aiohttp.ClientConnectionError):
                await c.generate([1])
            assert time.monotonic() - start < 0.3  # never retried

    asyncio.run(main())


def test_cli_serves_a_checkpoint(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import entry_points

    from miles_rollout.cli import main

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "miles-rollout"]
    assert script.load() is main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()
    argv = ["serve", "--model-path", str(model_dir), "--port", str(port), "--weight-version", "cli"]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(argv, stop=stop)))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, resp = _call("GET", f"http://127.0.0.1:{port}/get_weight_version")
                break
            except aiohttp.ClientConnectionError:
                assert time.monotonic() < deadline
                assert thread.is_alive()
                time.sleep(0.05)
        assert (status, resp) == (200, {"weight_version": "cli"})
    finally:
        stop.set()
        thread.join(timeout=30)
    assert result == [0]
    assert f"at http://127.0.0.1:{port}" in capsys.readouterr().out
    assert main(["serve", "--model-path", "/no/such/dir"]) == 2
    assert "does not exist" in capsys.readouterr().err
