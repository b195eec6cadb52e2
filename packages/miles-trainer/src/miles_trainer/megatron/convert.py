"""HF <-> megatron-core weights for Llama / Qwen3 (dense) and Qwen3-MoE, bit for bit.

HF names here are checkpoint names (what ``save_pretrained`` writes and SGLang loads): one
``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert. transformers 5 keeps Qwen3-MoE experts
stacked in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``); `stack_experts` / `unstack_experts` convert between the two.

Megatron names are those of a GPTModel built with megatron-core's local layers (layer numbers
local to the pipeline stage). One rank of a (tp, pp, ep, etp) layout holds:

- ``embedding.word_embeddings.weight`` (first stage), ``output_layer.weight`` (last stage;
  absent when tied on one stage): vocabulary rows ``[t * Vp/tp, (t+1) * Vp/tp)`` of the padded
  vocabulary ``Vp``; the padding rows are zero and map to nothing.
- ``self_attention.linear_qkv.weight``: the rank's query groups, each ``[its q heads; k; v]``
  (Megatron's interleaved fused QKV); ``linear_proj`` and ``mlp.linear_fc2``: columns split.
- ``mlp.linear_fc1.weight``: ``[gate rows of the rank; up rows of the rank]``.
- ``mlp.router.weight`` and every norm: whole. Experts: EP rank k holds experts
  ``[k E/ep, (k+1) E/ep)`` as ``mlp.experts.local_experts.{j}``, split over ``etp`` like the
  dense MLP.

Splitting and joining are slices and concatenations only, so HF -> Megatron -> HF returns the
same bits. miles-transfer's `megatron_layout` describes the same shards under Transformer
Engine names (`te_name`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelDims",
    "Parallel",
    "Rule",
    "hf_names",
    "hf_shapes",
    "hf_to_megatron",
    "megatron_to_hf",
    "rank_rules",
    "shard",
    "stack_experts",
    "te_name",
    "unshard",
    "unstack_experts",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The numbers that fix the parameter shapes of a supported HF model.

    Attributes:
        hidden: hidden size H; intermediate: dense MLP size (0 for MoE).
        num_layers, num_heads, num_kv_heads, head_dim: the decoder's shape.
        vocab: HF vocabulary size; padded_vocab: Megatron's (a multiple of the TP size).
        num_experts, moe_intermediate: routed experts per layer and one expert's size (0: dense).
        tie: ``lm_head`` shares ``embed_tokens``; qk_norm: per-head q/k RMSNorm (Qwen3).
    """

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    padded_vocab: int
    num_experts: int
    moe_intermediate: int
    tie: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config: Any, *, vocab_multiple: int) -> ModelDims:
        """Read a transformers Llama / Qwen3 / Qwen3-MoE config.

        Args:
            config: the HF config.
            vocab_multiple: pad the vocabulary to a multiple of this (divisible-by x tp).

        Raises:
            ValueError: an unsupported model type or feature (named in the message).
        """
        mtype = getattr(config, "model_type", None)
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the Megatron backend converts {SUPPORTED_MODEL_TYPES} models, not "
                f"{mtype!r}; use trainer.backend: fsdp for this model"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r}: only SwiGLU (silu) is supported")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise ValueError(f"{flag}=True is not supported by the Megatron conversion")
        num_experts = int(getattr(config, "num_experts", 0) or 0)
        sparse_step = int(getattr(config, "decoder_sparse_step", 1))
        if num_experts and (sparse_step != 1 or getattr(config, "mlp_only_layers", [])):
            raise ValueError("MoE models with dense layers (mlp_only_layers) are not supported")
        heads = int(config.num_attention_heads)
        vocab = int(config.vocab_size)
        return cls(
            hidden=int(config.hidden_size),
            intermediate=0 if num_experts else int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            vocab=vocab,
            padded_vocab=-(-vocab // vocab_multiple) * vocab_multiple,
            num_experts=num_experts,
            moe_intermediate=int(getattr(config, "moe_intermediate_size", 0) or 0),
            tie=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=mtype in ("qwen3", "qwen3_moe"),
        )


@dataclass(frozen=True, slots=True)
class Parallel:
    """Sizes of a Megatron layout and this rank's coordinates in it."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0


@dataclass(frozen=True, slots=True)
class Rule:
    """How one Megatron tensor is made of HF tensors.

    Attributes:
        local: the Megatron name on this rank.
        hf: the HF names it holds (q, k, v for "qkv"; gate, up for "gate_up").
        kind: "whole", "vocab" (rows, padded), "cols" (columns split), "qkv", "gate_up".
        group: the ranks it is split over: "" (replicated), "tp" or "etp".
        copy: a second copy of an HF tensor (the tied output layer on the last of several
            stages): loaded, but not emitted when gathering.
    """

    local: str
    hf: tuple[str, ...]
    kind: str
    group: str = ""
    copy: bool = False


def hf_names(dims: ModelDims) -> list[str]:
    """Every HF checkpoint name of the model, in layer order."""
    out = ["model.embed_tokens.weight"]
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        out.append(p + "input_layernorm.weight")
        out += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if dims.qk_norm:
            out += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        out.append(p + "post_attention_layernorm.weight")
        if dims.num_experts:
            out.append(p + "mlp.gate.weight")
            for e in range(dims.num_experts):
                out += [p + f"mlp.experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down")]
        else:
            out += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    out.append("model.norm.weight")
    if not dims.tie:
        out.append("lm_head.weight")
    return out


def hf_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The shape of every HF checkpoint tensor, in `hf_names` order."""
    H, D, V = dims.hidden, dims.head_dim, dims.vocab
    out: dict[str, tuple[int, ...]] = {}
    for name in hf_names(dims):
        leaf = name.rsplit(".", 2)[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = (V, H)
        elif leaf == "q_proj":
            out[name] = (dims.num_heads * D, H)
        elif leaf in ("k_proj", "v_proj"):
            out[name] = (dims.num_kv_heads * D, H)
        elif leaf == "o_proj":
            out[name] = (H, dims.num_heads * D)
        elif leaf in ("q_norm", "k_norm"):
            out[name] = (D,)
        elif leaf == "gate" and ".mlp.gate." in name:
            out[name] = (dims.num_experts, H)
        elif leaf in ("gate_proj", "up_proj"):
            out[name] = (dims.moe_intermediate if ".experts." in name else dims.intermediate, H)
        elif leaf == "down_proj":
            out[name] = (H, dims.moe_intermediate if ".experts." in name else dims.intermediate)
        else:  # norms
            out[name] = (H,)
    return out


def rank_rules(dims: ModelDims, par: Parallel) -> list[Rule]:
    """The Megatron tensors of a rank at ``par`` (the same for every TP rank of a stage)."""
    if dims.num_layers % par.pp:
        raise ValueError(
            f"num_hidden_layers ({dims.num_layers}) must divide by pp ({par.pp}): "
            "Megatron gives every pipeline stage the same number of layers"
        )
    per_stage = dims.num_layers // par.pp
    first, last = par.pp_rank == 0, par.pp_rank == par.pp - 1
    rules: list[Rule] = []
    if first:
        rules.append(
            Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "tp")
        )
    for j in range(per_stage):
        i = par.pp_rank * per_stage + j
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
        a, s = hf + "self_attn.", mg + "self_attention."
        rules.append(Rule(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), "whole"))
        qkv = (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        rules.append(Rule(s + "linear_qkv.weight", qkv, "qkv", "tp"))
        if dims.qk_norm:
            rules.append(Rule(s + "q_layernorm.weight", (a + "q_norm.weight",), "whole"))
            rules.append(Rule(s + "k_layernorm.weight", (a + "k_norm.weight",), "whole"))
        rules.append(Rule(s + "linear_proj.weight", (a + "o_proj.weight",), "cols", "tp"))
        rules.append(
            Rule(
                mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "whole"
            )
        )
        if not dims.num_experts:
            gu = (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
            rules.append(Rule(mg + "mlp.linear_fc1.weight", gu, "gate_up", "tp"))
            rules.append(
                Rule(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "cols", "tp")
            )
            continue
        rules.append(Rule(mg + "mlp.router.weight", (hf + "mlp.gate.weight",), "whole"))
        if dims.num_experts % par.ep:
            raise ValueError(f"num_experts ({dims.num_experts}) must divide by ep ({par.ep})")
        local = dims.num_experts // par.ep
        for jj in range(local):
            e = par.ep_rank * local + jj
            x, q = f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.local_experts.{jj}."
            gu = (x + "gate_proj.weight", x + "up_proj.weight")
            rules.append(Rule(q + "linear_fc1.weight", gu, "gate_up", "etp"))
            rules.append(Rule(q + "linear_fc2.weight", (x + "down_proj.weight",), "cols", "etp"))
    if last:
        rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "whole"))
        if not dims.tie:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", "tp"))
        elif par.pp > 1:
            rules.append(
                Rule(
                    "output_layer.weight", ("model.embed_tokens.weight",), "vocab", "tp", copy=True
                )
            )
    return rules


def _group(rule: Rule, par: Parallel) -> tuple[int, int]:
    """(rank, size) of this rank in the rule's split group."""
    if rule.group == "tp":
        return par.tp_rank, par.tp
    if rule.group == "etp":
        return par.etp_rank, par.etp
    return 0, 1


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) must be divisible by {b} for this Megatron layout")
    return a // b


def shard(
    rule: Rule, full: Mapping[str, torch.Tensor], dims: ModelDims, rank: int, size: int
) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s local tensor of ``rule``, cut from full HF tensors (a copy)."""
    ts = [full[n] for n in rule.hf]
    if rule.kind == "whole":
        return ts[0].clone()
    if rule.kind == "vocab":
        rows = dims.padded_vocab // size
        out = ts[0].new_zeros(rows, ts[0].shape[1])
        start = rank * rows
        n = max(0, min(dims.vocab, start + rows) - start)
        out[:n] = ts[0][start : start + n]
        return out
    if rule.kind == "cols":
        n = _div(ts[0].shape[1], size, f"{rule.hf[0]} columns")
        return ts[0][:, rank * n : (rank + 1) * n].clone()
    if rule.kind == "gate_up":
        n = _div(ts[0].shape[0], size, f"{rule.hf[0]} rows")
        return torch.cat([t[rank * n : (rank + 1) * n] for t in ts])
    assert rule.kind == "qkv", rule.kind
    q, k, v = ts
    G, D, H = dims.num_kv_heads, dims.head_dim, dims.hidden
    g = _div(G, size, "num_key_value_heads (query groups split over TP)")
    qpg = dims.num_heads // G
    fused_GRH = torch.cat([q.view(G, qpg * D, H), k.view(G, D, H), v.view(G, D, H)], dim=1)
    return fused_GRH[rank * g : (rank + 1) * g].reshape(-1, H).clone()


def unshard(rule: Rule, parts: list[torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """The full HF tensors of ``rule`` from its local tensors on every rank of its group."""
    if rule.kind == "whole":
        return {rule.hf[0]: parts[0]}
    if rule.kind == "vocab":
        return {rule.hf[0]: torch.cat(parts)[: dims.vocab]}
    if rule.kind == "cols":
        return {rule.hf[0]: torch.cat(parts, dim=1)}
    if rule.kind == "gate_up":
        halves = [p.chunk(2) for p in parts]
        return {
            rule.hf[0]: torch.cat([h[0] for h in halves]),
            rule.hf[1]: torch.cat([h[1] for h in halves]),
        }
    assert rule.kind == "qkv", rule.kind
    G, D, H = dims.num_kv_heads, dims.head_dim, dims.hidden
    qpg = dims.num_heads // G
    fused_GRH = torch.cat(parts).view(G, (qpg + 2) * D, H)
    q, k, v = fused_GRH.split([qpg * D, D, D], dim=1)
    return {
        rule.hf[0]: q.reshape(-1, H),
        rule.hf[1]: k.reshape(-1, H),
        rule.hf[2]: v.reshape(-1, H),
    }


def hf_to_megatron(
    full: Mapping[str, torch.Tensor], dims: ModelDims, par: Parallel
) -> dict[str, torch.Tensor]:
    """The local tensors of the rank at ``par`` from a full HF state (checkpoint names).

    Raises:
        KeyError: an HF tensor the layout needs is missing.
    """
    missing = [n for r in rank_rules(dims, par) for n in r.hf if n not in full]
    if missing:
        raise KeyError(f"HF state lacks {len(missing)} tensors, e.g. {missing[:4]}")
    out = {}
    for rule in rank_rules(dims, par):
        out[rule.local] = shard(rule, full, dims, *_group(rule, par))
    return out


def megatron_to_hf(
    shards: Mapping[Parallel, Mapping[str, torch.Tensor]], dims: ModelDims
) -> dict[str, torch.Tensor]:
    """Join the local tensors of every rank of a layout into the full HF state.

    Args:
        shards: each rank's local tensors under its coordinates (data-parallel replicas left
            out: one entry per (tp, pp, ep, etp) coordinate set).
        dims: the model.

    Returns:
        HF name -> tensor, in `hf_names` order.
    """
    out: dict[str, torch.Tensor] = {}
    for par in shards:
        for rule in rank_rules(dims, par):
            rank, size = _group(rule, par)
            if rank != 0 or rule.copy:
                continue
            field = {"tp": "tp_rank", "etp": "etp_rank"}.get(rule.group)
            peers = [replace(par, **{field: r}) if field else par for r in range(size)]
            out.update(unshard(rule, [shards[p][rule.local] for p in peers], dims))
    return {n: out[n] for n in hf_names(dims)}


_TE_NAMES = (
    (
        re.compile(r"(decoder\.layers\.\d+\.)input_layernorm\.weight$"),
        r"\1self_attention.linear_qkv.layer_norm_weight",
    ),
)
_TE_DENSE = (
    re.compile(r"(decoder\.layers\.\d+\.)pre_mlp_layernorm\.weight$"),
    r"\1mlp.linear_fc1.layer_norm_weight",
)


def te_name(name: str, *, moe: bool) -> str:
    """The Transformer Engine spelling of a local-layer Megatron name (norms fused into the
    following linear layer; an MoE layer keeps its own pre-MLP norm)."""
    for pattern, repl in _TE_NAMES:
        name = pattern.sub(repl, name)
    if not moe:
        name = _TE_DENSE[0].sub(_TE_DENSE[1], name)
    return name


_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$"
)


def unstack_experts(
    named: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked expert tensors -> per-expert checkpoint names (views, no copy);
    other tensors pass through."""
    for name, t in named:
        m = _STACKED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}{e}.down_proj.weight", t[e]
            else:
                gate, up = t[e].chunk(2)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up


def stack_experts(
    named: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint names -> transformers' stacked ``gate_up_proj`` / ``down_proj``.

    The stacked pair of a layer is emitted once all ``num_experts`` of its experts have
    arrived (`megatron_to_hf` and the trainer's gather emit a layer's experts together).
    """
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in named:
        m = _PER_EXPERT.match(name)
        if m is None:
            yield name, t
            continue
        prefix = m.group(1)
        layer = pending.setdefault(prefix, {})
        layer[(int(m.group(2)), m.group(3))] = t
        if len(layer) < 3 * num_experts:
            continue
        experts = range(num_experts)
        gate_up = [torch.cat([layer[(e, "gate")], layer[(e, "up")]]) for e in experts]
        yield prefix + "gate_up_proj", torch.stack(gate_up)
        yield prefix + "down_proj", torch.stack([layer[(e, "down")] for e in experts])
        del pending[prefix]
