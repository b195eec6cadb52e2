"""Shared helpers of the Megatron backend tests: tiny HF configs, checkpoints and their states.

Also imported by the 2-process worker script, so it must not depend on pytest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 61  # odd on purpose: the Megatron vocabulary is padded (and the padding masked)


def tiny_qwen3_config(*, tie: bool = True) -> Any:
    """A 2-layer hidden-64 Qwen3 (GQA 4/2, q/k norm) like ``_trainer_testlib.make_tiny_model``."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.2,
        tie_word_embeddings=tie,
    )


def tiny_llama_config() -> Any:
    """A 2-layer hidden-64 Llama (untied, no q/k norm)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def tiny_moe_config() -> Any:
    """A 2-layer hidden-64 Qwen3-MoE: 4 experts, top-2, normalised top-k, untied."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def hf_model(config: Any, *, seed: int = 0) -> Any:
    """A randomly initialised HF causal LM of ``config`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def hf_state(config: Any, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint-named state of `hf_model` (per-expert names; tied weights once)."""
    from miles_trainer.megatron.convert import unstack_experts

    model = hf_model(config, seed=seed)
    state = dict(unstack_experts(model.state_dict().items()))
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in state.items()}


def save_tiny(config: Any, path: Path, *, seed: int = 0) -> Path:
    """Save `hf_model` of ``config`` to ``path`` (with a word-level tokenizer) and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf_model(config, seed=seed).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t1", pad_token="t0")
    tok.save_pretrained(path)
    return path


def checkpoint_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint-named fp32 state of the HF model saved at ``path``."""
    from transformers import AutoModelForCausalLM

    from miles_trainer.megatron.convert import unstack_experts

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = dict(unstack_experts(model.state_dict().items()))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in state.items()}


def run_workers(
    model_dir: Path, out_dir: Path, spec: dict[str, Any], *, nproc: int = 2
) -> dict[str, Any]:
    """Run `_megatron_worker.py` on ``nproc`` gloo processes; return rank 0's result."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(Path(__file__).parent / "_megatron_worker.py"),
        str(model_dir),
        str(out_dir),
        json.dumps(spec),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result: dict[str, Any] = json.loads((out_dir / "result.json").read_text())
    return result
