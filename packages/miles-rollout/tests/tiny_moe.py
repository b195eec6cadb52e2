"""A tiny random Qwen3-MoE checkpoint for the MoE and R3 tests (built from a config)."""

from __future__ import annotations

from pathlib import Path

import torch

NUM_LAYERS = 3
DENSE_LAYERS = (1,)  # Qwen3-MoE's mlp_only_layers: a dense MLP among the MoE layers
NUM_EXPERTS = 8
TOP_K = 2


def build_qwen3_moe(path: Path, *, seed: int = 0) -> Path:
    """Save a random 3-layer Qwen3-MoE (8 experts, top-2, layer 1 dense) to ``path``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=list(DENSE_LAYERS),
        norm_topk_prob=True,
        max_position_embeddings=128,
        initializer_range=0.15,  # peaked distributions: clear greedy and top-k margins
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path
