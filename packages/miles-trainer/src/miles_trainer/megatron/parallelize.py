"""Megatron process groups, the GPTModel of an HF config, and its DDP wrapper.

Everything here imports megatron-core; `miles_trainer.megatron.trainer` imports this module
lazily so that the package imports without the optional dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles_trainer.megatron import cpu_compat
from miles_trainer.megatron.config import MegatronConfig
from miles_trainer.megatron.convert import ModelDims, Parallel, hf_to_megatron, te_name

with cpu_compat.quiet_megatron():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "MegatronRMSNorm",
    "build_model",
    "init_model_parallel",
    "load_hf_weights",
    "ps",
    "rank_coords",
    "transformer_config",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_model_parallel(cfg: MegatronConfig, world_size: int, seed: int) -> int:
    """(Re)build Megatron's process groups for ``cfg`` over the default group; return dp.

    Raises:
        ValueError: the world size does not fit ``cfg`` (see `MegatronConfig.data_parallel_size`).
    """
    dp = cfg.data_parallel_size(world_size)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    with cpu_compat.quiet_megatron():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            expert_model_parallel_size=cfg.ep,
            expert_tensor_parallel_size=cfg.etp,
        )
    cpu_compat.define_missing_te_names()
    if cpu_compat.needs_cpu_compat():
        cpu_compat.install()
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dp


def rank_coords(cfg: MegatronConfig) -> Parallel:
    """This rank's coordinates in the layout (after `init_model_parallel`)."""
    return Parallel(
        tp=cfg.tp,
        pp=cfg.pp,
        ep=cfg.ep,
        etp=cfg.etp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


class MegatronRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way megatron-core builds its norms, usable with sequence
    parallelism: its weight is marked ``sequence_parallel`` so that megatron's
    `finalize_model_grads` sums its gradient over the TP ranks (each saw a slice of the
    sequence). megatron's own torch norm wrapper refuses sequence parallelism; Apex's and TE's
    fused norms, which accept it, need CUDA."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _rope(hf_config: Any) -> dict[str, Any]:
    """GPTModel's RoPE arguments for the HF config (default and Llama-3 RoPE)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or "default"
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None)) or 10000.0
    if rope_type == "default":
        return {"rotary_base": theta}
    if rope_type == "llama3":
        p = {**legacy, **params}
        # megatron's Llama-3 scaling fixes these three; other values would change the maths.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        fixed["original_max_position_embeddings"] = 8192
        if any(float(p.get(k, v)) != float(v) for k, v in fixed.items()):
            raise ValueError(f"llama3 RoPE with {p} differs from megatron's fixed {fixed}")
        return {
            "rotary_base": theta,
            "rope_scaling": True,
            "rope_scaling_factor": float(p.get("factor", 8.0)),
        }
    raise ValueError(f"RoPE type {rope_type!r} is not supported by the Megatron backend")


def transformer_config(
    hf_config: Any, dims: ModelDims, cfg: MegatronConfig, dtype: str
) -> TransformerConfig:
    """megatron-core's TransformerConfig for an HF Llama / Qwen3 / Qwen3-MoE config.

    Dropout is off (RL training: the training forward must equal the rollout's), fused CUDA
    kernels are off on the CPU, MoE routing is softmax top-k without load-balancing loss or
    capacity (as HF computes it).
    """
    cpu = cpu_compat.needs_cpu_compat()
    torch_dtype = _DTYPES[dtype]
    kwargs: dict[str, Any] = {}
    if dims.num_experts:
        kwargs.update(
            num_moe_experts=dims.num_experts,
            moe_ffn_hidden_size=dims.moe_intermediate,
            moe_router_topk=int(hf_config.num_experts_per_tok),
            # HF: softmax over all experts, top-k, renormalised if norm_topk_prob; that equals
            # a softmax over the top-k logits. Without renormalisation: softmax first.
            moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher,
        )
    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden,
        ffn_hidden_size=dims.intermediate or dims.moe_intermediate,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=dims.qk_norm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=not cpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=not cpu,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        fp16=torch_dtype == torch.float16,
        use_cpu_initialization=cpu,
        # The HF weights replace the initial values, but megatron marks tensor-parallel
        # weights (``tensor_model_parallel``, which the gradient norm relies on) only while
        # initialising them.
        perform_initialization=True,
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
        sequence_parallel=cfg.sequence_parallel,
        # The trainer pads a step's micro-batches to one shape when pipelining.
        variable_seq_lengths=False,
        **kwargs,
    )


@dataclass(slots=True)
class BuiltModel:
    """A GPTModel stage and what the trainer needs to know about it."""

    module: GPTModel
    config: TransformerConfig


def build_model(hf_config: Any, dims: ModelDims, cfg: MegatronConfig, dtype: str) -> BuiltModel:
    """This rank's GPTModel stage (unwrapped, uninitialised weights) for the HF config."""
    if (
        dims.num_experts
        and cfg.moe_token_dispatcher == "alltoall"
        and cpu_compat.needs_cpu_compat()
    ):
        raise ValueError(
            'MegatronConfig.moe_token_dispatcher "alltoall" needs CUDA (megatron-core syncs it '
            'on CUDA streams); use "allgather" without a GPU'
        )
    tcfg = transformer_config(hf_config, dims, cfg, dtype)
    per_stage = dims.num_layers // cfg.pp
    if cfg.transformer_impl == "transformer_engine":
        try:
            from megatron.core.extensions.transformer_engine import TENorm
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )
        except ImportError as exc:
            raise ImportError(
                'MegatronConfig.transformer_impl = "transformer_engine" needs Transformer '
                "Engine: pip install transformer-engine[pytorch] (CUDA only), or use "
                'transformer_impl: "local"'
            ) from exc
        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=dims.num_experts or None, qk_layernorm=dims.qk_norm
        )
        block = TransformerBlockSubmodules(layer_specs=[layer] * per_stage, layer_norm=TENorm)
    else:
        layer = get_gpt_layer_local_spec(
            num_experts=dims.num_experts or None, qk_layernorm=dims.qk_norm, normalization="RMSNorm"
        )
        layer.submodules.input_layernorm = MegatronRMSNorm
        layer.submodules.pre_mlp_layernorm = MegatronRMSNorm
        attn = layer.submodules.self_attention.submodules
        if dims.qk_norm:
            attn.q_layernorm = MegatronRMSNorm
            attn.k_layernorm = MegatronRMSNorm
        block = TransformerBlockSubmodules(
            layer_specs=[layer] * per_stage, layer_norm=MegatronRMSNorm
        )
    # cpu_scope: with tied embeddings over pipeline stages megatron moves the output
    # layer's copy to CUDA before syncing it with the first stage's embedding.
    with cpu_compat.cpu_scope():
        module = GPTModel(
            config=tcfg,
            transformer_layer_spec=block,
            vocab_size=dims.padded_vocab,
            max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=dims.tie,
            position_embedding_type="rope",
            **_rope(hf_config),
        )
    if not cpu_compat.needs_cpu_compat():
        module.cuda(torch.cuda.current_device())
    return BuiltModel(module=module, config=tcfg)


def load_hf_weights(
    module: torch.nn.Module,
    full: dict[str, torch.Tensor],
    dims: ModelDims,
    par: Parallel,
    *,
    te: bool,
) -> None:
    """Copy this rank's shards of the full HF state into ``module`` (before DDP wrapping).

    Raises:
        RuntimeError: the module's parameters and the conversion disagree (a bug, named).
    """
    local = hf_to_megatron(full, dims, par)
    if te:
        local = {te_name(n, moe=bool(dims.num_experts)): t for n, t in local.items()}
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(local))
    extra = sorted(set(local) - set(params))
    if missing or extra:
        raise RuntimeError(
            f"Megatron conversion mismatch: parameters without HF source {missing[:4]}, "
            f"converted tensors without parameter {extra[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            src = local[name]
            if src.shape != p.shape:
                raise RuntimeError(
                    f"{name}: converted shape {tuple(src.shape)} != {tuple(p.shape)}"
                )
            p.copy_(src)


def wrap_ddp(built: BuiltModel, cfg: MegatronConfig) -> DistributedDataParallel:
    """Megatron's DDP around the stage: contiguous fp32 gradient buffers, reduced over dp."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron():
        ddp = DistributedDataParallel(
            config=built.config, ddp_config=ddp_config, module=built.module
        )
    built.config.no_sync_func = ddp.no_sync
    built.config.finalize_model_grads_func = finalize_model_grads
    return ddp
