"""Our server behind a real sglang-router (skipped unless the ``sglang-router`` binary exists).

Install it with ``pip install sglang-router`` (a Rust binary; no GPU needed) or point
``MILES_SGLANG_ROUTER`` at the executable.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
from router_launch import launch_router, stop_router

from miles_rollout import EngineConfig, SamplingParams, SGLangClient, serve

ROUTER = os.environ.get("MILES_SGLANG_ROUTER") or shutil.which(
    "sglang-router", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
)


@pytest.mark.slow
@pytest.mark.skipif(ROUTER is None, reason="sglang-router is not installed")
def test_generate_through_sglang_router_with_session_keys(model_dir: Path) -> None:
    assert ROUTER is not None
    engines = [EngineConfig(model_path=str(model_dir), seed=i).build() for i in range(2)]
    handles = [serve(e) for e in engines]
    args = ["--worker-urls", *[h.url for h in handles], "--policy", "manual"]
    args += ["--assignment-mode", "min_load", "--dp-aware", "--log-level", "warn"]
    proc, url = launch_router(ROUTER, args, lambda u: b'"is_healthy":true' in _get(u + "/workers"))
    try:

        async def main() -> None:
            async with SGLangClient(url, timeout=60) as c:
                for key in ("sess-a", "sess-b", "sess-c"):
                    before = _tokens(engines)
                    for turn in range(2):
                        out = await c.generate(
                            [5, 6, 7],
                            SamplingParams(max_new_tokens=4, ignore_eos=True, seed=1),
                            rid=f"{key}-{turn}",
                            routing_key=key,
                        )
                        assert out.rid == f"{key}-{turn}"
                        assert out.completion_tokens == 4
                        assert out.output_logprobs is not None
                        assert out.weight_version == "0"
                    grew = [a - b for a, b in zip(_tokens(engines), before)]
                    assert sorted(grew) == [0, 8], "both turns of a session hit one engine"
                assert await c.flush_cache()

        asyncio.run(main())
    finally:
        stop_router(proc)
        for h in handles:
            h.close()
        for e in engines:
            e.shutdown()


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bytes(resp.read())
    except OSError:
        return b""


def _tokens(engines: list) -> list[int]:  # type: ignore[type-arg]
    return [e.server_info()["internal_states"][0]["num_generated_tokens"] for e in engines]
