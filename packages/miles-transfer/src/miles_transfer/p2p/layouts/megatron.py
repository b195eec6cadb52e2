"""The Megatron-core trainer layout of a Qwen3(-MoE) model: TP, PP, EP (and DP replicas).

Local names follow Megatron-core's GPTModel with Transformer Engine layers, with layer numbers
local to the pipeline stage as Megatron stores them:

- `embedding.word_embeddings.weight` (stage 0) and `output_layer.weight` (last stage; a copy of
  the embedding when tied): vocabulary-parallel rows, the vocabulary padded to a multiple of
  128 * tp (the padding rows hold no HF data).
- `decoder.layers.{j}.self_attention.linear_qkv.weight`: column parallel over query groups, and
  within each local group the rows are `[q heads of the group; k head; v head]` (Megatron's
  interleaved fused QKV). Needs num_kv_heads % tp == 0.
- `linear_proj` (o_proj) and `linear_fc2` (down_proj): row parallel (columns split).
- `linear_fc1`: `[gate rows of this rank; up rows of this rank]` (gated MLP, column parallel).
- Norms (`linear_qkv.layer_norm_weight`, `q_layernorm`, ...), the router: replicated.
- Experts: `mlp.experts.local_experts.{j}.linear_fc1/linear_fc2`; within a stage the tp * dp
  ranks form an expert grid with expert-TP (`etp`, fastest), then EP, then expert-DP replicas;
  EP rank k owns experts [k*E/ep, (k+1)*E/ep).

Ranks are ordered with TP fastest, then DP, then PP (Megatron's default order).
"""

from __future__ import annotations

from miles_transfer.p2p.layouts.base import Layout, LocalTensor, Piece, make_layout
from miles_transfer.p2p.layouts.models import ModelShape, qwen3_params, whole

__all__ = ["megatron_layout"]


def _rows(name: str, start: int, n: int, cols: int, at: int) -> Piece:
    return Piece(name, (start, 0), (n, cols), (at, 0))


def _cols(name: str, start: int, n: int, rows: int, at: int = 0) -> Piece:
    return Piece(name, (0, start), (rows, n), (0, at))


def _lt(shape: tuple[int, ...], m: ModelShape, *pieces: Piece) -> LocalTensor:
    return LocalTensor(shape, m.dtype, pieces)


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"megatron_layout: {what} ({a}) must be divisible by {b}")
    return a // b


def megatron_layout(
    m: ModelShape, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, etp: int = 1
) -> Layout:
    """The Megatron-core layout of `m` on tp * dp * pp ranks (see the module docstring).

    Raises:
        ValueError: a size does not divide (layers by pp, kv heads by tp, experts by ep, ...).
    """
    for k, v in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep), ("etp", etp)):
        if v < 1:
            raise ValueError(f"megatron_layout: {k} must be >= 1, got {v}")
    params = qwen3_params(m)
    H, D = m.hidden, m.head_dim
    per_stage = _div(m.num_layers, pp, "num_layers (pipeline stages)")
    groups = _div(m.num_kv_heads, tp, "num_kv_heads (Megatron splits query groups over TP)")
    qpg = m.num_heads // m.num_kv_heads
    vocab_rows = -(-m.vocab // (128 * tp)) * 128
    if m.num_experts:
        _div(tp * dp, etp * ep, "tp * dp (the expert grid etp * ep)")
        experts = _div(m.num_experts, ep, "num_experts (expert parallel)")
        e_inter = _div(m.moe_intermediate, etp, "moe_intermediate (expert TP)")
    else:
        inter = _div(m.intermediate, tp, "intermediate (TP)")

    ranks: list[dict[str, LocalTensor]] = []
    for stage in range(pp):
        for d in range(dp):
            for t in range(tp):
                r: dict[str, LocalTensor] = {}

                def vocab(local: str, hf: str, t: int = t, r: dict[str, LocalTensor] = r) -> None:
                    start = t * vocab_rows
                    n = max(0, min(m.vocab, start + vocab_rows) - start)
                    pieces = (_rows(hf, start, n, H, 0),) if n else ()
                    r[local] = LocalTensor((vocab_rows, H), m.dtype, pieces)

                if stage == 0:
                    vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight")
                for j in range(per_stage):
                    i = stage * per_stage + j
                    hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
                    a, s = hf + "self_attn.", mg + "self_attention."
                    blk = (qpg + 2) * D
                    qkv: list[Piece] = []
                    for g_local in range(groups):
                        g = t * groups + g_local
                        at = g_local * blk
                        qkv.append(_rows(a + "q_proj.weight", g * qpg * D, qpg * D, H, at))
                        qkv.append(_rows(a + "k_proj.weight", g * D, D, H, at + qpg * D))
                        qkv.append(_rows(a + "v_proj.weight", g * D, D, H, at + (qpg + 1) * D))
                    r[s + "linear_qkv.weight"] = _lt((groups * blk, H), m, *qkv)
                    r[s + "linear_qkv.layer_norm_weight"] = whole(
                        hf + "input_layernorm.weight", params[hf + "input_layernorm.weight"]
                    )
                    r[s + "q_layernorm.weight"] = whole(
                        a + "q_norm.weight", params[a + "q_norm.weight"]
                    )
                    r[s + "k_layernorm.weight"] = whole(
                        a + "k_norm.weight", params[a + "k_norm.weight"]
                    )
                    qcols = m.num_heads * D // tp
                    r[s + "linear_proj.weight"] = _lt(
                        (H, qcols), m, _cols(a + "o_proj.weight", t * qcols, qcols, H)
                    )
                    post = hf + "post_attention_layernorm.weight"
                    if not m.num_experts:
                        p = hf + "mlp."
                        r[mg + "mlp.linear_fc1.layer_norm_weight"] = whole(post, params[post])
                        r[mg + "mlp.linear_fc1.weight"] = _lt(
                            (2 * inter, H),
                            m,
                            _rows(p + "gate_proj.weight", t * inter, inter, H, 0),
                            _rows(p + "up_proj.weight", t * inter, inter, H, inter),
                        )
                        r[mg + "mlp.linear_fc2.weight"] = _lt(
                            (H, inter), m, _cols(p + "down_proj.weight", t * inter, inter, H)
                        )
                        continue
                    r[mg + "pre_mlp_layernorm.weight"] = whole(post, params[post])
                    r[mg + "mlp.router.weight"] = whole(
                        hf + "mlp.gate.weight", params[hf + "mlp.gate.weight"]
                    )
                    local_rank = d * tp + t
                    et, ek = local_rank % etp, (local_rank // etp) % ep
                    for jj in range(experts):
                        e = ek * experts + jj
                        p = f"{hf}mlp.experts.{e}."
                        q = f"{mg}mlp.experts.local_experts.{jj}."
                        r[q + "linear_fc1.weight"] = _lt(
                            (2 * e_inter, H),
                            m,
                            _rows(p + "gate_proj.weight", et * e_inter, e_inter, H, 0),
                            _rows(p + "up_proj.weight", et * e_inter, e_inter, H, e_inter),
                        )
                        r[q + "linear_fc2.weight"] = _lt(
                            (H, e_inter), m, _cols(p + "down_proj.weight", et * e_inter, e_inter, H)
                        )
                if stage == pp - 1:
                    r["decoder.final_layernorm.weight"] = whole(
                        "model.norm.weight", params["model.norm.weight"]
                    )
                    head = (
                        "model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight"
                    )
                    if not (m.tie_word_embeddings and pp == 1):
                        vocab("output_layer.weight", head)
                ranks.append(r)
    kind = f"megatron(tp={tp},pp={pp},dp={dp},ep={ep},etp={etp})"
    return make_layout(kind, params, ranks)
