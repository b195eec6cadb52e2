"""HF <-> Megatron weight conversion: bit-exact round trips over every rank of a layout, and the
same shards as miles-transfer's `megatron_layout` describes."""

from __future__ import annotations

from collections.abc import Callable
from itertools import product
from typing import Any

import pytest
import torch
from _megatron_testlib import hf_state, tiny_llama_config, tiny_moe_config, tiny_qwen3_config

from miles_trainer.megatron.convert import (
    ModelDims,
    Parallel,
    hf_names,
    hf_shapes,
    hf_to_megatron,
    megatron_to_hf,
    stack_experts,
    te_name,
    unstack_experts,
)


def _layout_shards(
    full: dict[str, torch.Tensor], dims: ModelDims, tp: int, pp: int, ep: int, etp: int
) -> dict[Parallel, dict[str, torch.Tensor]]:
    out = {}
    for t, s, k, et in product(range(tp), range(pp), range(ep), range(etp)):
        par = Parallel(tp=tp, pp=pp, ep=ep, etp=etp, tp_rank=t, pp_rank=s, ep_rank=k, etp_rank=et)
        out[par] = hf_to_megatron(full, dims, par)
    return out


def _assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name


@pytest.mark.parametrize(
    ("make", "tp", "pp", "ep", "etp"),
    [
        (tiny_qwen3_config, 1, 1, 1, 1),
        (tiny_qwen3_config, 2, 1, 1, 1),
        (tiny_qwen3_config, 2, 2, 1, 1),
        (tiny_llama_config, 2, 1, 1, 1),
        (tiny_moe_config, 2, 1, 2, 1),
        (tiny_moe_config, 1, 2, 4, 2),
    ],
)
def test_round_trip_is_bit_exact(
    make: Callable[[], Any], tp: int, pp: int, ep: int, etp: int
) -> None:
    config = make()
    full = hf_state(config)
    dims = ModelDims.from_hf_config(config, vocab_multiple=128 * tp)
    assert sorted(full) == sorted(hf_names(dims))
    shards = _layout_shards(full, dims, tp, pp, ep, etp)
    _assert_bits_equal(megatron_to_hf(shards, dims), full)
    # Padding rows of the vocabulary are zero, real rows hold the embedding.
    emb = shards[Parallel(tp=tp, pp=pp, ep=ep, etp=etp)]["embedding.word_embeddings.weight"]
    assert emb.shape[0] == dims.padded_vocab // tp


def test_qkv_is_interleaved_per_query_group() -> None:
    config = tiny_qwen3_config()  # 4 heads, 2 kv heads, head_dim 16
    full = hf_state(config)
    dims = ModelDims.from_hf_config(config, vocab_multiple=256)
    local = hf_to_megatron(full, dims, Parallel(tp=2, tp_rank=1))
    qkv = local["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (full[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    # TP rank 1 holds query group 1: q heads 2 and 3, then k head 1, then v head 1.
    assert torch.equal(qkv, torch.cat([q[32:64], k[16:32], v[16:32]]))


@pytest.mark.parametrize(
    ("make", "tp", "pp", "ep", "etp"),
    [(tiny_qwen3_config, 2, 2, 1, 1), (tiny_moe_config, 2, 1, 2, 1), (tiny_moe_config, 1, 1, 2, 1)],
)
def test_shards_match_miles_transfer_megatron_layout(
    make: Callable[[], Any], tp: int, pp: int, ep: int, etp: int
) -> None:
    mt = pytest.importorskip("miles_transfer.p2p.layouts")
    config = make()
    full = hf_state(config)
    dims = ModelDims.from_hf_config(config, vocab_multiple=128 * tp)
    shape = mt.ModelShape.from_hf_config(config, dtype=torch.float32)
    dp = (ep * etp) // tp if ep * etp > tp else 1
    layout = mt.megatron_layout(shape, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
    moe = bool(dims.num_experts)
    for rank in range(layout.world_size):
        t, d, s = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        local_rank = d * tp + t  # the layout's expert grid: etp fastest, then ep
        par = Parallel(
            tp=tp,
            pp=pp,
            ep=ep,
            etp=etp,
            tp_rank=t,
            pp_rank=s,
            ep_rank=(local_rank // etp) % ep,
            etp_rank=local_rank % etp,
        )
        ours = {te_name(n, moe=moe): x for n, x in hf_to_megatron(full, dims, par).items()}
        want = mt.materialize(layout, rank, full)
        assert ours.keys() == want.keys()
        for name in want:
            assert torch.equal(ours[name], want[name]), (rank, name)


def test_expert_stacking_matches_transformers() -> None:
    from transformers import Qwen3MoeForCausalLM

    config = tiny_moe_config()
    torch.manual_seed(0)
    module_sd = Qwen3MoeForCausalLM(config).state_dict()
    per_expert = dict(unstack_experts(module_sd.items()))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in per_expert
    restacked = dict(stack_experts(per_expert.items(), config.num_experts))
    assert restacked.keys() == module_sd.keys()
    for name, t in module_sd.items():
        assert torch.equal(restacked[name], t), name


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_type", "gpt2", "use trainer.backend: fsdp"),
        ("hidden_act", "gelu", "SwiGLU"),
        ("attention_bias", True, "attention_bias"),
    ],
)
def test_unsupported_models_are_refused(field: str, value: object, message: str) -> None:
    config = tiny_qwen3_config()
    object.__setattr__(config, field, value)
    with pytest.raises(ValueError, match=message):
        ModelDims.from_hf_config(config, vocab_multiple=128)


def test_layers_must_divide_over_stages() -> None:
    config = tiny_qwen3_config()
    full = hf_state(config)
    dims = ModelDims.from_hf_config(config, vocab_multiple=128)
    with pytest.raises(ValueError, match="must divide by pp"):
        hf_to_megatron(full, dims, Parallel(pp=3))


@pytest.mark.parametrize("make", [tiny_qwen3_config, tiny_llama_config, tiny_moe_config])
def test_hf_shapes(make: Callable[[], Any]) -> None:
    config = make()
    full = hf_state(config)
    shapes = hf_shapes(ModelDims.from_hf_config(config, vocab_multiple=128))
    assert shapes == {n: tuple(t.shape) for n, t in full.items()}
