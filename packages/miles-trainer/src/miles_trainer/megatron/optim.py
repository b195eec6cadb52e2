"""megatron-core's optimizer (distributed or not) from the trainer config, and one guarded step."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from miles_trainer.megatron import cpu_compat

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from miles_trainer.config import TrainerConfig

__all__ = ["apply_step", "build_optimizer", "grad_norm"]


def build_optimizer(
    config: TrainerConfig, model_chunks: list[torch.nn.Module]
) -> MegatronOptimizer:
    """Adam(W) with fp32 master weights, through ``get_megatron_optimizer``.

    ``config.megatron.distributed_optimizer`` shards the master weights and moments over the
    data-parallel ranks. The learning rate is constant (``config.lr``). megatron-core applies
    weight decay to matrices only, not to norm weights or biases (its default grouping).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        clip_grad=config.grad_clip if config.grad_clip is not None else 0.0,
        use_distributed_optimizer=config.megatron.distributed_optimizer,
        bf16=config.dtype == "bfloat16",
        fp16=config.dtype == "float16",
        params_dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            config.dtype, torch.float16
        ),
    )
    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron():
        return get_megatron_optimizer(ocfg, model_chunks)


def grad_norm(optimizer: MegatronOptimizer) -> float:
    """Prepare the main gradients and return their global 2-norm (inf on an fp16 overflow).
    Collective over the model's ranks; nothing is changed yet."""
    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron():
        if optimizer.prepare_grads():
            return math.inf
        return float(optimizer.get_grad_norm() or 0.0)


def apply_step(optimizer: MegatronOptimizer, norm: float) -> None:
    """Clip by ``norm`` (from `grad_norm`) and step: megatron's ``step()`` after its
    norm. Collective over the model's ranks."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron():
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=opt.config.clip_grad,
                    total_norm=norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        optimizer.step_with_ready_grads()
