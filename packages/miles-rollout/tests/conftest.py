"""Shared fixtures: tiny random Qwen3 checkpoints built from a config (no download)."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_rollout import Engine, EngineConfig

VOCAB = 128
CONTEXT = 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2  # <|im_end|>


def _tokenizer() -> Any:
    """A character-level HF fast tokenizer whose vocabulary is exactly VOCAB tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    extra = [f"<|x{i}|>" for i in range(VOCAB - len(SPECIALS) - len(chars))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars + extra)}
    assert len(vocab) == VOCAB
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS + extra)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def build_qwen3(path: Path, *, seed: int = 0, tokenizer: bool = True, tied: bool = True) -> Path:
    """Save a random 2-layer Qwen3 (hidden 64) to ``path``; return ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=tied,
        # Larger than the default 0.02 so next-token distributions are peaked: greedy choices
        # then have clear margins and do not flip on float rounding.
        initializer_range=0.15,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    if tokenizer:
        _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint with a character tokenizer (EOS = ``<|im_end|>``, id 2)."""
    return build_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def model_dir_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as ``model_dir``, other random weights, no tokenizer."""
    return build_qwen3(tmp_path_factory.mktemp("qwen3_v2"), seed=1, tokenizer=False)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    """The same checkpoint loaded by transformers (float32), the reference for exactness."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    """A shared engine; tests using it must leave it unpaused with its initial weights."""
    eng = EngineConfig(model_path=str(model_dir), max_running_requests=16, seed=0).build()
    yield eng
    eng.shutdown()


@pytest.fixture
def fresh_engine(model_dir: Path) -> Iterator[Engine]:
    """A private engine for tests that pause it or change its weights."""
    eng = EngineConfig(model_path=str(model_dir), max_running_requests=16, seed=0).build()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def teacher_logprobs(hf_model: Any) -> Callable[[list[int], list[int], float], list[float]]:
    """``f(prompt, output, T)``: ``log_softmax(logits / T)[token]`` per output token from one
    teacher-forced HF forward pass (T = 1 when T == 0, the greedy convention)."""

    def compute(prompt: list[int], output: list[int], temperature: float) -> list[float]:
        ids = torch.tensor([prompt + output])
        with torch.inference_mode():
            logits = hf_model(ids).logits[0].float()
        t = 1.0 if temperature == 0.0 else temperature
        logp = torch.log_softmax(logits / t, dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
        return logp[positions, torch.tensor(output)].tolist()

    return compute


@pytest.fixture(scope="session")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., Path]:
    """``f(**kwargs)``: build another tiny checkpoint (see ``build_qwen3``) in a new dir."""

    def make(**kwargs: Any) -> Path:
        return build_qwen3(tmp_path_factory.mktemp("ckpt"), **kwargs)

    return make
