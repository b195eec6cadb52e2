"""R3 capture: each token's experts, SGLang's wire format, and the dense-model error."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from tiny_moe import DENSE_LAYERS, NUM_LAYERS, TOP_K, build_qwen3_moe

from miles_rollout import Engine, EngineConfig, SamplingParams, SGLangClient, serve
from miles_rollout._http_generate import decode_routed_experts


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 100 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe_r3"))


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path) -> Iterator[Engine]:
    with EngineConfig(model_path=str(moe_dir), max_running_requests=8).build() as eng:
        yield eng


@pytest.fixture(scope="module")
def moe_hf(moe_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _hf_topk(hf: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' router top-k for every position: int32 [len(tokens), layers, top_k]."""
    with torch.inference_mode():
        router_logits = hf(torch.tensor([tokens]), output_router_logits=True).router_logits
    out = torch.full((len(tokens), NUM_LAYERS, TOP_K), -1, dtype=torch.int32)
    moe_layers = [i for i in range(NUM_LAYERS) if i not in DENSE_LAYERS]
    assert len(router_logits) == len(moe_layers)
    for layer, logits in zip(moe_layers, router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        out[:, layer] = torch.topk(probs, TOP_K, dim=-1).indices.to(torch.int32)
    return out


def test_captured_experts_equal_the_transformers_router_top_k(
    moe_engine: Engine, moe_hf: Any
) -> None:
    """Several requests joining and leaving, one retracted and resumed: each token's experts
    (prompt tokens from prefill, output tokens from decode) are transformers' own top-k."""
    params = [SamplingParams(max_new_tokens=14 + 6 * i, ignore_eos=True, seed=i) for i in range(3)]
    prompts = [_prompt(5 + 11 * i, 3 * i) for i in range(3)]
    futs = [moe_engine.submit(p, sp, return_routed_experts=True) for p, sp in zip(prompts, params)]
    deadline = time.monotonic() + 20
    while moe_engine.server_info()["internal_states"][0]["num_running_reqs"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    moe_engine.pause_generation("retract")
    moe_engine.continue_generation()
    late = moe_engine.submit(_prompt(9, 40), params[0], return_routed_experts=True)
    for prompt, fut in [*zip(prompts, futs), (_prompt(9, 40), late)]:
        out = fut.result(timeout=30)
        experts = out.routed_experts
        assert experts is not None
        # SGLang's shape: every token that went through a forward pass (all but the last).
        assert experts.shape == (len(prompt) + out.completion_tokens - 1, NUM_LAYERS, TOP_K)
        assert experts.dtype == torch.int32
        want = _hf_topk(moe_hf, prompt + out.output_ids[:-1])
        assert torch.equal(experts, want)
        assert bool((experts[:, DENSE_LAYERS[0]] == -1).all())  # a dense layer has none


def test_routed_experts_over_http_in_sglang_format(moe_engine: Engine) -> None:
    body: dict[str, Any] = {
        "input_ids": [[5, 6, 7, 8], [9, 10]],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 2},
        "return_routed_experts": [True, False],
    }

    async def main() -> tuple[list[dict[str, Any]], Any]:
        with serve(moe_engine) as handle:
            async with (
                aiohttp.ClientSession() as s,
                s.post(handle.url + "/generate", json=body) as r,
            ):
                assert r.status == 200
                resp = await r.json()
            async with SGLangClient(handle.url) as c:
                parsed = await c.generate(
                    [5, 6, 7, 8], body["sampling_params"], return_routed_experts=True
                )
        return resp, parsed

    resp, parsed = asyncio.run(main())
    meta = resp[0]["meta_info"]
    assert "routed_experts" not in resp[1]["meta_info"]  # asked for per item
    raw = base64.b64decode(meta["routed_experts"])
    assert len(raw) == (4 + 3 - 1) * NUM_LAYERS * TOP_K * 4  # int32, little-endian
    assert meta["routed_experts_shape"] == [6, NUM_LAYERS, TOP_K]
    decoded = decode_routed_experts(meta["routed_experts"], meta["routed_experts_shape"])
    local = moe_engine.generate(
        [5, 6, 7, 8],
        SamplingParams(max_new_tokens=3, ignore_eos=True, seed=2),
        return_routed_experts=True,
    )
    assert local.routed_experts is not None
    assert torch.equal(decoded, local.routed_experts)
    assert parsed.routed_experts is not None
    assert torch.equal(parsed.routed_experts, local.routed_experts)


def test_return_routed_experts_on_a_dense_model_is_a_clear_error(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"needs a mixture-of-experts model.*dense qwen3"):
        engine.submit([1, 2, 3], return_routed_experts=True)

    async def main() -> tuple[int, str]:
        with serve(engine) as handle:
            async with aiohttp.ClientSession() as s:
                body = {"input_ids": [1, 2, 3], "return_routed_experts": True}
                async with s.post(handle.url + "/generate", json=body) as r:
                    return r.status, (await r.json())["error"]["message"]

    status, message = asyncio.run(main())
    assert status == 400
    assert "mixture-of-experts" in message
    assert engine.generate([1, 2], SamplingParams(max_new_tokens=2)).completion_tokens == 2


def test_client_reads_a_stock_sglang_payload_without_a_shape() -> None:
    """A real SGLang server sends only the flat base64; the client keeps [tokens, layers*k]."""
    flat = torch.arange(4 * 6, dtype=torch.int32)
    payload = base64.b64encode(flat.numpy().tobytes()).decode("ascii")

    async def generate(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "output_ids": [7, 8],
                "meta_info": {
                    "id": "r",
                    "finish_reason": {"type": "length", "length": 2},
                    "prompt_tokens": 3,
                    "completion_tokens": 2,
                    "weight_version": "w",
                    "routed_experts": payload,
                },
            }
        )

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with SGLangClient(f"http://127.0.0.1:{port}") as c:
                return await c.generate([1, 2, 3], return_routed_experts=True)
        finally:
            await runner.cleanup()

    out = asyncio.run(main())
    assert out.routed_experts is not None
    assert torch.equal(out.routed_experts, flat.reshape(4, 6))
