"""Shared fixtures for cross-package and end-to-end tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
