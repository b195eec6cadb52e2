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


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the block runs (bound, not
    listening: nobody else can take it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def test_client_retries_5xx_and_connection_errors_never_4xx() -> None:
    """Counted attempts against a stub server: 503 (with Retry-After) and 500 are retried up to
    the bound, 400/401/404 never; generate only with generate_retries."""
    hits: dict[str, int] = {}
    script: dict[str, list[int]] = {}
    ok = {
        "/generate": {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}},
        "/get_server_info": {"dp_size": 1},
    }

    async def handler(request: web.Request) -> web.Response:
        hits[request.path] = hits.get(request.path, 0) + 1
        plan = script.get(request.path, [])
        status = plan.pop(0) if plan else 200
        if status == 200:
            return web.json_response(ok[request.path])
        return web.json_response(
            {"error": {"message": f"status {status}"}}, status=status, headers={"Retry-After": "0"}
        )

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        try:
            async with SGLangClient(url, retries=2, backoff_s=0.0, generate_retries=3) as c:
                script["/get_server_info"] = [503, 500]
                assert await c.get_server_info() == {"dp_size": 1}
                assert hits.pop("/get_server_info") == 3
                script["/get_server_info"] = [503, 503, 503]
                with pytest.raises(SGLangHTTPError) as info:
                    await c.get_server_info()
                assert info.value.status == 503
                assert info.value.retry_after_s == 0.0
                assert hits.pop("/get_server_info") == 3  # 1 + retries
                script["/generate"] = [502, 503, 500]
                assert (await c.generate([1])).output_ids == [7]
                assert hits.pop("/generate") == 4
                for status in (400, 401, 404, 413):
                    script["/generate"] = [status]
                    with pytest.raises((ValueError, SGLangHTTPError)):
                        await c.generate([1])
                    assert hits.pop("/generate") == 1, status
            async with SGLangClient(url, retries=2, backoff_s=0.0) as c:
                script["/generate"] = [503]
                with pytest.raises(SGLangHTTPError):
                    await c.generate([1])  # generate_retries defaults to 0
                assert hits.pop("/generate") == 1
        finally:
            await runner.cleanup()
        with refusing_port() as port:
            async with SGLangClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.0) as c:
                assert await c.health() is False
                with pytest.raises(aiohttp.ClientConnectionError):
                    await c.get_server_info()

    asyncio.run(main())


def test_generate_retries_through_a_full_queue(fresh_engine: Engine) -> None:
    """A real 503 (the engine's queue is full) is retried with backoff until room frees up."""
    import logging

    from engine_faults import stalled

    retried = threading.Event()

    class OnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retry" in record.getMessage():
                retried.set()

    handler = OnRetry()
    logging.getLogger("miles_rollout.client").addHandler(handler)
    running = fresh_engine.config.max_running_requests
    batch = {
        "input_ids": [[5, 6, i] for i in range(running)],
        "sampling_params": {"max_new_tokens": 1},
    }

    async def one() -> list[int]:
        async with SGLangClient(url, backoff_s=0.05, generate_retries=1000) as c:
            return (await c.generate([5, 6], {"max_new_tokens": 2})).output_ids

    try:
        with serve(fresh_engine, max_queued_requests=0) as handle:
            url = handle.url
            results: list[Any] = []
            with stalled(fresh_engine):
                filler = threading.Thread(
                    target=lambda: results.append(_call("POST", url + "/generate", batch))
                )
                filler.start()
                deadline = time.monotonic() + 60
                while fresh_engine.load()[0]["num_reqs"] < running:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                late = threading.Thread(target=lambda: results.append(asyncio.run(one())))
                late.start()
                assert retried.wait(60)  # it got a 503 and is backing off
            filler.join(120)
            late.join(120)
    finally:
        logging.getLogger("miles_rollout.client").removeHandler(handler)
    assert results[0][0] == 200
    assert len(results[1]) == 2


def test_cli_serves_a_checkpoint(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import entry_points

    from miles_rollout.cli import main

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "miles-rollout"]
    assert script.load() is main
    stop = threading.Event()
    argv = ["serve", "--model-path", str(model_dir), "--port", "0", "--weight-version", "cli"]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(argv, stop=stop)))
    thread.start()
    try:
        out = ""
        deadline = time.monotonic() + 120
        while " at http://" not in out:  # the CLI prints its URL once it serves
            assert time.monotonic() < deadline
            assert thread.is_alive()
            time.sleep(0.05)
            out += capsys.readouterr().out
        url = out.split(" at ", 1)[1].split()[0]
        status, resp = _call("GET", f"{url}/get_weight_version")
        assert (status, resp) == (200, {"weight_version": "cli"})
    finally:
        stop.set()
        thread.join(timeout=30)
    assert result == [0]
    assert main(["serve", "--model-path", "/no/such/dir"]) == 2
    assert "does not exist" in capsys.readouterr().err
