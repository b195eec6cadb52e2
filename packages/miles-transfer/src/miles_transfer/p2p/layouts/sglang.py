"""The SGLang rollout layout of a Qwen3(-MoE) model: engine TP, EP and DP ranks.

Local names follow SGLang's `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` after `load_weights`:

- `model.embed_tokens.weight`, `lm_head.weight`: VocabParallelEmbedding / ParallelLMHead, the
  vocabulary padded to a multiple of 64 and split evenly over TP (padding rows hold no HF data).
  With tied embeddings SGLang's lm_head is the embedding tensor: no separate local tensor.
- `self_attn.qkv_proj.weight` (QKVParallelLinear): `[q heads of this rank; k heads; v heads]`.
  With tp > num_kv_heads each KV head is replicated on tp / num_kv_heads consecutive ranks
  (rank t holds head t // (tp / num_kv_heads)); needs num_heads % tp == 0 and either
  num_kv_heads % tp == 0 or tp % num_kv_heads == 0.
- `self_attn.o_proj.weight`, `mlp.down_proj.weight`: RowParallelLinear (columns split).
- `mlp.gate_up_proj.weight` (MergedColumnParallelLinear): `[gate rows; up rows]` of this rank.
- MoE (FusedMoE): `mlp.experts.w13_weight` [E/ep, 2*I/moe_tp, H] holding `[gate; up]` per
  local expert and `mlp.experts.w2_weight` [E/ep, H, I/moe_tp]; moe_tp = tp / ep, and inside a
  TP group rank t is EP rank t // moe_tp and MoE-TP rank t % moe_tp. `mlp.gate.weight` (router)
  and all norms are replicated.

DP replicas are whole copies: rank `d * tp + t` is TP rank t of DP replica d (several engines
are more DP replicas).
"""

from __future__ import annotations

from miles_transfer.p2p.layouts.base import Layout, LocalTensor, Piece, make_layout
from miles_transfer.p2p.layouts.models import ModelShape, qwen3_params, whole

__all__ = ["sglang_layout"]


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"sglang_layout: {what} ({a}) must be divisible by {b}")
    return a // b


def sglang_layout(m: ModelShape, *, tp: int = 1, dp: int = 1, ep: int = 1) -> Layout:
    """The SGLang layout of `m` on tp * dp ranks (see the module docstring).

    Raises:
        ValueError: a size does not divide (heads by tp, experts by ep, tp by ep, ...).
    """
    for k, v in (("tp", tp), ("dp", dp), ("ep", ep)):
        if v < 1:
            raise ValueError(f"sglang_layout: {k} must be >= 1, got {v}")
    params = qwen3_params(m)
    H, D, dt = m.hidden, m.head_dim, m.dtype
    q_heads = _div(m.num_heads, tp, "num_heads (TP)")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ValueError(
            f"sglang_layout: tp ({tp}) must divide num_kv_heads ({m.num_kv_heads}) or be a "
            "multiple of it (KV heads are replicated then)"
        )
    kv_heads = max(1, m.num_kv_heads // tp)
    replicas = max(1, tp // m.num_kv_heads)
    vocab_rows = _div(-(-m.vocab // 64) * 64, tp, "the vocabulary padded to a multiple of 64")
    if m.num_experts:
        moe_tp = _div(tp, ep, "tp (EP splits the TP group)")
        experts = _div(m.num_experts, ep, "num_experts (EP)")
        e_inter = _div(m.moe_intermediate, moe_tp, "moe_intermediate (MoE TP = tp / ep)")
    else:
        inter = _div(m.intermediate, tp, "intermediate (TP)")

    def rows(name: str, start: int, n: int, at: int, cols: int = H) -> Piece:
        return Piece(name, (start, 0), (n, cols), (at, 0))

    def cols(name: str, start: int, n: int) -> Piece:
        return Piece(name, (0, start), (H, n), (0, 0))

    ranks: list[dict[str, LocalTensor]] = []
    for _replica in range(dp):
        for t in range(tp):
            r: dict[str, LocalTensor] = {}

            def vocab(name: str, t: int = t, r: dict[str, LocalTensor] = r) -> None:
                start = t * vocab_rows
                n = max(0, min(m.vocab, start + vocab_rows) - start)
                r[name] = LocalTensor((vocab_rows, H), dt, (rows(name, start, n, 0),) if n else ())

            vocab("model.embed_tokens.weight")
            kv0 = t // replicas if replicas > 1 else t * kv_heads
            for i in range(m.num_layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                qn = q_heads * D
                r[a + "qkv_proj.weight"] = LocalTensor(
                    (qn + 2 * kv_heads * D, H),
                    dt,
                    (
                        rows(a + "q_proj.weight", t * qn, qn, 0),
                        rows(a + "k_proj.weight", kv0 * D, kv_heads * D, qn),
                        rows(a + "v_proj.weight", kv0 * D, kv_heads * D, qn + kv_heads * D),
                    ),
                )
                r[a + "o_proj.weight"] = LocalTensor(
                    (H, qn), dt, (cols(a + "o_proj.weight", t * qn, qn),)
                )
                for name in (a + "q_norm.weight", a + "k_norm.weight"):
                    r[name] = whole(name, params[name])
                for name in (p + "input_layernorm.weight", p + "post_attention_layernorm.weight"):
                    r[name] = whole(name, params[name])
                if not m.num_experts:
                    g = p + "mlp."
                    r[g + "gate_up_proj.weight"] = LocalTensor(
                        (2 * inter, H),
                        dt,
                        (
                            rows(g + "gate_proj.weight", t * inter, inter, 0),
                            rows(g + "up_proj.weight", t * inter, inter, inter),
                        ),
                    )
                    r[g + "down_proj.weight"] = LocalTensor(
                        (H, inter), dt, (cols(g + "down_proj.weight", t * inter, inter),)
                    )
                    continue
                r[p + "mlp.gate.weight"] = whole(
                    p + "mlp.gate.weight", params[p + "mlp.gate.weight"]
                )
                ek, et = t // moe_tp, t % moe_tp
                w13: list[Piece] = []
                w2: list[Piece] = []
                for j in range(experts):
                    e = ek * experts + j
                    x = f"{p}mlp.experts.{e}."
                    s = et * e_inter
                    w13.append(Piece(x + "gate_proj.weight", (s, 0), (e_inter, H), (j, 0, 0)))
                    w13.append(Piece(x + "up_proj.weight", (s, 0), (e_inter, H), (j, e_inter, 0)))
                    w2.append(Piece(x + "down_proj.weight", (0, s), (H, e_inter), (j, 0, 0)))
                r[p + "mlp.experts.w13_weight"] = LocalTensor(
                    (experts, 2 * e_inter, H), dt, tuple(w13)
                )
                r[p + "mlp.experts.w2_weight"] = LocalTensor((experts, H, e_inter), dt, tuple(w2))
            r["model.norm.weight"] = whole("model.norm.weight", params["model.norm.weight"])
            if not m.tie_word_embeddings:
                vocab("lm_head.weight")
            ranks.append(r)
    return make_layout(f"sglang(tp={tp},dp={dp},ep={ep})", params, ranks)
