"""Shared fixtures for cross-package and end-to-end tests."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo policy, briefly warmed up (fewer SFT steps than the demo: tests need a real
    checkpoint with a tokenizer, not a good policy)."""
    tool = load_tool("make_tiny_model")
    out = tmp_path_factory.mktemp("models") / "tiny-qwen3-arith"
    return Path(tool.build(tool.TinyModelSpec(sft_steps=20), out, quiet=True))


def save_tiny_smol(out: Path, *, max_position_embeddings: int = 4096) -> Path:
    """A 2-layer random Llama (hidden 32) with SmolLM2-135M-Instruct's tokenizer, saved to
    ``out``: the real chat template and tokenizer of the agentic tests at a tiny model's cost."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from miles_rollout.models import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir(weights=False))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@contextlib.contextmanager
def tito_sessions(model: Path, *, max_running_requests: int = 4) -> Iterator[SimpleNamespace]:
    """The TITO session server over an embedded engine serving ``model``: ``.h`` (its handle:
    ``url``, ``session_url(id)``) and ``.tokenizer``."""
    from transformers import AutoTokenizer

    from miles_rollout import EngineConfig, serve
    from miles_rollout.session import serve_sessions

    engine = EngineConfig(
        model_path=str(model), max_running_requests=max_running_requests, seed=0
    ).build()
    try:
        with serve(engine) as http, serve_sessions(http.url, model) as h:
            yield SimpleNamespace(h=h, tokenizer=AutoTokenizer.from_pretrained(model))
    finally:
        engine.shutdown()


def call_json(method: str, url: str, body: Any = None) -> Any:
    """One HTTP request with a JSON body (or none); the JSON reply."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())
