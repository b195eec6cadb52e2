"""Fixtures of the miles-trainer tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _trainer_testlib import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (tied embeddings) with a tokenizer, built once per session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3") / "model")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one intra-op thread is several times faster
    than two competing with other processes (spin-waiting threads), and deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
