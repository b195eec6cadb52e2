"""Tiny HF models made from a config (offline) for the checkpoint and QAT tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 96
# Dims are multiples of 128 so that every format's layout takes every Linear weight.
HIDDEN = 128


def qwen3_config(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    kw: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }
    kw.update(overrides)
    return Qwen3Config(**kw)


def qwen3_moe_config(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    kw: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def build(config: Any, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A randomly initialised causal LM for ``config``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.eval()
    return model


def save(model: Any, path: Path) -> Path:
    """save_pretrained plus two tokenizer-like side files (copied by the exporter)."""
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}) + "\n")
    (path / "chat_template.jinja").write_text("{{ messages }}\n")
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with safetensors itself."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def logits(model: Any, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()
