"""Layouts and the transfer planner: exact coverage, bytes moved == bytes needed, caching."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from p2p_testutil import DENSE, MOE, random_bits

from miles_transfer import plan_transfer
from miles_transfer.p2p import TransferPlan, reshard_local
from miles_transfer.p2p.layouts import (
    Layout,
    ModelShape,
    ParamSpec,
    fsdp_layout,
    materialize,
    megatron_layout,
    qwen3_params,
    replicated_layout,
    sglang_layout,
    split_layout,
)


def assert_exact(plan: TransferPlan, full: dict[str, torch.Tensor]) -> None:
    """Every destination element of every piece written exactly once, with the right bits."""
    src, dst = plan.src, plan.dst
    shards = {s: materialize(src, s, full) for s in range(src.world_size)}
    for d in range(dst.world_size):
        assert plan.bytes_moved(d) == plan.bytes_needed(d)
        want = materialize(dst, d, full)
        got = {d: dst.rank(d).allocate()}
        reshard_local(plan, shards, got, backend="torch")
        for name, t in want.items():
            assert torch.equal(t.view(torch.int16), got[d][name].view(torch.int16)), (d, name)
        # Coverage count: each op's box adds 1; pieces must read exactly 1, padding 0.
        counts = {n: torch.zeros(lt.shape, dtype=torch.int32) for n, lt in dst.rank(d).tensors}
        for op in plan.ops_to(d):
            box = counts[op.dst_name]
            lead = len(op.dst_shape) - len(op.size)
            for k, a in enumerate(op.dst_start):
                box = box.narrow(k, a, 1 if k < lead else op.size[k - lead])
            box += 1
        expect = {n: torch.zeros(lt.shape, dtype=torch.int32) for n, lt in dst.rank(d).tensors}
        for n, lt in dst.rank(d).tensors:
            for p in lt.pieces:
                box = expect[n]
                for k, (a, s) in enumerate(zip(p.local_start, p.local_size())):
                    box = box.narrow(k, a, s)
                box += 1
        for n in counts:
            assert torch.equal(counts[n], expect[n]), (d, n)


@st.composite
def dense_case(draw):
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if heads % t == 0]))
    m = ModelShape(
        hidden=draw(st.sampled_from([8, 16, 24])),
        intermediate=8 * draw(st.integers(1, 3)),
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=draw(st.sampled_from([2, 4])),
        vocab=draw(st.integers(1, 150)),
        tie_word_embeddings=draw(st.booleans()),
    )
    src_kind = draw(st.sampled_from(["fsdp", "megatron", "replicated"]))
    if src_kind == "fsdp":
        src = fsdp_layout(qwen3_params(m), draw(st.integers(1, 5)))
    elif src_kind == "megatron":
        mtp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if kv % t == 0 and 8 % t == 0]))
        src = megatron_layout(
            m, tp=mtp, pp=draw(st.sampled_from([1, 2])), dp=draw(st.sampled_from([1, 2]))
        )
    else:
        src = replicated_layout(qwen3_params(m), draw(st.integers(1, 3)))
    dst = sglang_layout(m, tp=tp, dp=draw(st.sampled_from([1, 2])))
    return m, src, dst


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dense_case(), st.integers(0, 2**16))
def test_dense_plans_are_exact_tp_1_2_4_8_gqa_fused_qkv_gate_up(case, seed):
    m, src, dst = case
    assert_exact(plan_transfer(src, dst), random_bits(qwen3_params(m), seed))


@st.composite
def moe_case(draw):
    experts = draw(st.sampled_from([2, 4, 8]))
    m = ModelShape(
        hidden=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=draw(st.sampled_from([1, 2, 4])),
        head_dim=2,
        vocab=64,
        num_experts=experts,
        moe_intermediate=8,
    )
    tp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if tp % e == 0 and experts % e == 0]))
    dst = sglang_layout(m, tp=tp, ep=ep, dp=draw(st.sampled_from([1, 2])))
    if draw(st.booleans()):
        src = fsdp_layout(qwen3_params(m), draw(st.integers(1, 4)))
    else:
        mtp = draw(st.sampled_from([t for t in (1, 2) if m.num_kv_heads % t == 0]))
        dp = draw(st.sampled_from([1, 2]))
        mep = draw(
            st.sampled_from([e for e in (1, 2, 4) if (mtp * dp) % e == 0 and experts % e == 0])
        )
        src = megatron_layout(m, tp=mtp, dp=dp, ep=mep)
    return m, src, dst


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_case(), st.integers(0, 2**16))
def test_moe_plans_are_exact_under_expert_parallelism(case, seed):
    m, src, dst = case
    assert_exact(plan_transfer(src, dst), random_bits(qwen3_params(m), seed))


def test_megatron_fused_qkv_interleaves_groups_and_sglang_replicates_kv_heads():
    m = ModelShape(
        hidden=4, intermediate=4, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=1, vocab=8
    )
    full = {
        n: torch.arange(s.numel).reshape(s.shape).to(torch.bfloat16)
        for n, s in qwen3_params(m).items()
    }
    full["model.layers.0.self_attn.k_proj.weight"] += 100
    full["model.layers.0.self_attn.v_proj.weight"] += 200
    qkv = materialize(megatron_layout(m, tp=1), 0, full)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    # rows per group g: q heads 2g, 2g+1; k head g; v head g (head_dim 1, so row = head)
    assert qkv[:, 0].tolist() == [0, 4, 100, 200, 8, 12, 104, 204]
    ranks = [materialize(sglang_layout(m, tp=4), t, full) for t in range(4)]
    got = [r["model.layers.0.self_attn.qkv_proj.weight"][:, 0].tolist() for r in ranks]
    assert got == [[0, 100, 200], [4, 100, 200], [8, 104, 204], [12, 104, 204]]


def test_fsdp_rows_follow_torch_chunk_and_trailing_ranks_may_be_empty():
    params = {"w": qwen3_params(DENSE)["model.norm.weight"]}  # 32 rows
    lay = fsdp_layout(params, 5)  # chunks of 7: 7, 7, 7, 7, 4
    assert [r.as_dict()["w"].shape[0] for r in lay.ranks] == [7, 7, 7, 7, 4]
    lay = fsdp_layout(params, 3 * 16)  # chunks of 1: 32 ranks hold a row, 16 hold nothing
    sizes = [r.as_dict()["w"].shape[0] for r in lay.ranks]
    assert sizes == [t.shape[0] for t in torch.chunk(torch.zeros(32), 48)] + [0] * 16


def test_vocab_padding_is_not_moved():
    plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 2), sglang_layout(DENSE, tp=8))
    emb = [o for o in plan.ops_to(7) if o.dst_name == "model.embed_tokens.weight"]
    # V = 200 padded to 256 over 8 ranks: rank 7 holds rows 224..255, all padding
    assert emb == []
    assert plan.dst.rank(7).as_dict()["model.embed_tokens.weight"].shape == (32, 32)


def test_replicas_are_read_once_and_spread_over_sources():
    src = megatron_layout(DENSE, tp=2, dp=2)  # two full replicas
    plan = plan_transfer(src, sglang_layout(DENSE, tp=1, dp=4))
    for d in range(4):
        assert plan.bytes_moved(d) == plan.bytes_needed(d)
    used = {o.src_rank for o in plan.ops if o.name.endswith("norm.weight")}
    assert used == {0, 1, 2, 3}


def test_plans_are_cached_by_layout_content():
    a = plan_transfer(megatron_layout(DENSE, tp=2), sglang_layout(DENSE, tp=4))
    b = plan_transfer(megatron_layout(DENSE, tp=2), sglang_layout(DENSE, tp=4))
    assert a is b
    c = plan_transfer(megatron_layout(DENSE, tp=2), sglang_layout(DENSE, tp=2))
    assert c is not a
    assert a.buckets(0, 1, 1024) is a.buckets(0, 1, 1024)


def test_byte_runs_and_split_describe_the_same_bytes():
    plan = plan_transfer(megatron_layout(MOE, tp=2, ep=2), sglang_layout(MOE, tp=2, ep=2))
    full = random_bits(qwen3_params(MOE), 3)
    shards = [materialize(plan.src, s, full) for s in range(plan.src.world_size)]
    for d in range(plan.dst.world_size):
        want = materialize(plan.dst, d, full)
        got = {n: bytearray(t.numel() * t.element_size()) for n, t in want.items()}
        for op in plan.ops_to(d):
            assert sum(n for _, _, n in op.byte_runs()) == op.nbytes
            parts = op.split(7)
            assert sum(p.nbytes for p in parts) == op.nbytes
            assert all(p.nbytes <= max(7, op.itemsize) for p in parts)
            src = shards[op.src_rank][op.src_name].reshape(-1).view(torch.uint8)
            for p in parts:
                for so, do, n in p.byte_runs():
                    got[op.dst_name][do : do + n] = bytes(src[so : so + n].tolist())
        for n, t in want.items():
            assert bytes(got[n]) == bytes(t.reshape(-1).view(torch.uint8).tolist()), n


def test_buckets_respect_the_size_and_keep_every_byte():
    plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 2), sglang_layout(DENSE, tp=2))
    for s in range(2):
        for d in range(2):
            buckets = plan.buckets(s, d, 1000)
            assert all(sum(o.nbytes for o in b) <= 1000 for b in buckets)
            assert sum(o.nbytes for b in buckets for o in b) == sum(
                o.nbytes for o in plan.ops_between(s, d)
            )
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan.buckets(0, 0, 0)


def test_clear_errors_for_mismatched_or_incomplete_layouts():
    dense = qwen3_params(DENSE)
    partial: Layout = fsdp_layout({k: v for k, v in dense.items() if "lm_head" not in k}, 2)
    with pytest.raises(ValueError, match=r"lm_head\.weight.*does not have"):
        plan_transfer(partial, sglang_layout(DENSE, tp=2))
    fp32 = fsdp_layout({k: type(v)(v.shape, torch.float32) for k, v in dense.items()}, 2)
    with pytest.raises(ValueError, match="cast or fix"):
        plan_transfer(fp32, sglang_layout(DENSE, tp=2))
    with pytest.raises(ValueError, match="num_kv_heads"):
        megatron_layout(DENSE, tp=4)  # 2 query groups cannot split over 4 ranks
    with pytest.raises(ValueError, match="num_heads"):
        sglang_layout(DENSE, tp=16)
    with pytest.raises(ValueError, match="num_experts"):
        sglang_layout(ModelShape(**{**_fields(MOE), "num_experts": 3}), tp=2, ep=2)
    with pytest.raises(ValueError, match=r"tp \(EP splits the TP group\)"):
        sglang_layout(MOE, tp=2, ep=4)
    with pytest.raises(ValueError, match=r"num_heads .* multiple"):
        ModelShape(
            hidden=8, intermediate=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=2, vocab=4
        )


def _fields(m: ModelShape) -> dict:
    return {f: getattr(m, f) for f in ModelShape.__dataclass_fields__}


def test_model_shape_from_a_transformers_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=4, vocab_size=50, num_experts=4, moe_intermediate_size=8, intermediate_size=32,
    )  # fmt: skip
    m = ModelShape.from_hf_config(cfg, dtype=torch.float32)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    names = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    specs = {n: (s.shape, s.dtype) for n, s in qwen3_params(m).items()}
    # transformers may store experts fused; compare the non-expert names and the expert count
    for n, spec in specs.items():
        if ".experts." not in n:
            assert names[n] == spec, n


def test_split_layout_any_model_column_and_row_parallel():
    params = {
        "fc1.weight": ParamSpec((8, 6), torch.bfloat16),
        "fc1.bias": ParamSpec((8,), torch.bfloat16),
        "fc2.weight": ParamSpec((5, 8), torch.bfloat16),
        "fc2.bias": ParamSpec((5,), torch.bfloat16),
    }
    dims = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    for tp in (1, 2, 4, 8):
        dst = split_layout(params, tp, dims, dp=2)
        assert dst.rank(1).as_dict()["fc2.weight"].shape == (5, 8 // tp)
        for src in (fsdp_layout(params, 3), split_layout(params, 2, {"fc1.weight": 1})):
            assert_exact(plan_transfer(src, dst), random_bits(params, tp))
    with pytest.raises(ValueError, match="cannot be split evenly"):
        split_layout(params, 3, dims)
    with pytest.raises(ValueError, match=r"does not have: \['fc3.weight'\]"):
        split_layout(params, 2, {"fc3.weight": 0})
