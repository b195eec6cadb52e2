"""megatron-core's optimizer (distributed or not) from the trainer config, and one guarded step."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from miles_trainer.megatron import cpu_compat

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from miles_trainer.config import TrainerConfig

__all__ = ["apply_step", "build_optimizer", "grad_norm", "load_optimizer_state", "optimizer_state"]


def build_optimizer(
    config: TrainerConfig, model_chunks: list[torch.nn.Module]
) -> MegatronOptimizer:
    """Adam(W) with fp32 master weights, through ``get_megatron_optimizer``.

    ``config.megatron.distributed_optimizer`` shards the master weights and moments over the
    data-parallel ranks. The trainer sets the learning rate before each step (``config.lr_at``,
    `miles_trainer._lr.set_lr`). megatron-core applies
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


def _parts(optimizer: MegatronOptimizer) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(opt: Any) -> list[torch.Tensor]:
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def optimizer_state(optimizer: MegatronOptimizer) -> list[dict[str, Any]]:
    """Copies of this rank's optimizer state: per (chained) optimizer, its fp32 main
    parameters (shards, with the distributed optimizer) and its inner torch optimizer's state
    (moments, step), plus the fp16 loss scaler's.

    megatron's own ``state_dict()`` leaves the distributed optimizer's parameter state to
    separate files; this keeps one rank's whole state in memory instead.
    """
    out = []
    for opt in _parts(optimizer):
        scaler = getattr(opt, "grad_scaler", None)
        out.append(
            {
                "main_params": [p.detach().clone() for p in _main_params(opt)],
                "inner": _clone(opt.optimizer.state_dict()),
                "grad_scaler": None if scaler is None else _clone(scaler.state_dict()),
            }
        )
    return out


def load_optimizer_state(optimizer: MegatronOptimizer, state: list[dict[str, Any]]) -> None:
    """Restore `optimizer_state` (values copied), then the model parameters from the main
    parameters (all-gathered over data-parallel replicas with the distributed optimizer).
    Collective."""
    parts = _parts(optimizer)
    assert len(parts) == len(state), "a state of another optimizer layout"
    with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron(), torch.no_grad():
        for opt, saved in zip(parts, state):
            for p, src in zip(_main_params(opt), saved["main_params"], strict=True):
                p.copy_(src)
            opt.optimizer.load_state_dict(_clone(saved["inner"]))
            if saved["grad_scaler"] is not None:
                opt.grad_scaler.load_state_dict(saved["grad_scaler"])
            if hasattr(opt, "_copy_main_params_to_model_params"):  # masters apart from params
                opt._copy_main_params_to_model_params()
            for chunk in getattr(opt, "model_chunks", []):
                if (
                    getattr(opt, "ddp_config", None) is not None
                    and opt.ddp_config.use_distributed_optimizer
                ):
                    chunk.start_param_sync(force_sync=True)


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return tree
