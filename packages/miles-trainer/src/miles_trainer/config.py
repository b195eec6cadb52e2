"""Typed configs: the trainer (`TrainerConfig`, which picks the backend) and its parts.

Each config validates itself in ``__post_init__`` (a `ValueError` naming the field and the fix)
and has a ``build()`` that makes its component. A recipe fills them from YAML under
``trainer:`` (``trainer.loss.clip_high``, ``trainer.offload.mode``, ...).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_trainer.advantages import AdvantageConfig
from miles_trainer.fsdp.config import FSDPConfig
from miles_trainer.losses import LossConfig
from miles_trainer.megatron.config import MegatronConfig

if TYPE_CHECKING:
    import torch

    from miles_trainer.trainer import Trainer

__all__ = [
    "BACKENDS",
    "DTYPES",
    "LR_DECAY_STYLES",
    "NONFINITE_POLICIES",
    "OFFLOAD_MODES",
    "REF_PLACEMENTS",
    "AdvantageConfig",
    "CriticConfig",
    "LossConfig",
    "OffloadConfig",
    "QATConfig",
    "ReferenceConfig",
    "TrainerConfig",
]

DTYPES = ("float32", "bfloat16", "float16")
OFFLOAD_MODES = ("none", "cpu", "nvme")
BACKENDS = ("fsdp", "megatron")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
REF_PLACEMENTS = ("device", "cpu")
NONFINITE_POLICIES = ("skip", "stop")


@dataclass(kw_only=True, slots=True)
class QATConfig:
    """INT4 quantization-aware training through miles-quant (``pip install miles-quant``).

    Every forward of the policy (training, old-logprob and `compute_logprobs` passes) computes
    with the selected weights fake-quantized to INT4, exactly as W4A16 rollout dequantizes
    them: groups along the input dim, the scale rounded to the compute dtype first. The
    gradient passes straight through to the full-precision master weights. Export the trained
    weights with ``miles_quant.checkpoint.export_checkpoint(dir, out, f"int4_g{group}",
    only=patterns)`` from a checkpoint saved in the compute dtype to get the same codes.

    Attributes:
        patterns: which parameters to fake-quantize: globs on parameter or module names, or
            "re:" + a regex. The default takes MoE expert weights (per-expert Linear weights
            and fused expert parameters).
        group: INT4 group size along the input dim: 32 or 128.
    """

    patterns: tuple[str, ...] = ("*.experts.*",)
    group: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.patterns, str) or not self.patterns:
            raise ValueError(
                f"QATConfig.patterns must be a non-empty tuple of patterns, got {self.patterns!r}"
            )
        if not all(isinstance(p, str) and p for p in self.patterns):
            raise ValueError(f"QATConfig.patterns must be non-empty strings, got {self.patterns}")
        self.patterns = tuple(self.patterns)
        if self.group not in (32, 128):
            raise ValueError(f"QATConfig.group must be 32 or 128, got {self.group}")

    def build(self, model: torch.nn.Module) -> Any:
        """Install INT4 fake quantization (straight-through gradient) on ``model``.

        Returns:
            miles-quant's ``QATHandle`` (``targets`` lists the fake-quantized parameters).

        Raises:
            ImportError: miles-quant is not installed.
            ValueError: no parameter matches ``patterns``, or one cannot be grouped.
        """
        try:
            from miles_quant.qat import apply_int4_qat
        except ImportError as e:
            raise ImportError(
                "TrainerConfig.qat needs miles-quant: pip install miles-quant "
                "(or pip install 'miles-trainer[quant]')"
            ) from e
        return apply_int4_qat(model, patterns=self.patterns, group=self.group)


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Where the AdamW state (fp32 master weights and moments) lives, through miles-offload.

    Attributes:
        mode: "none" (torch AdamW, state beside the parameters), "cpu" (CPU memory) or "nvme"
            (per-bucket files under ``path``, streamed three buckets at a time). "cpu" and
            "nvme" need the miles-offload package (``pip install 'miles-trainer[offload]'``) and
            give the same parameters as "none", bit for bit.
        path: directory for "nvme" state on node-local disk; rank r uses ``<path>/rank<r>``.
            Required with "nvme".
        bucket_mb: optimizer state per bucket in MiB (master + moments). > 0.
    """

    mode: str = "none"
    path: str | None = None
    bucket_mb: float = 64.0

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(
                f"OffloadConfig.mode must be one of {OFFLOAD_MODES}, got {self.mode!r}"
            )
        if self.mode == "nvme" and not self.path:
            raise ValueError(
                'OffloadConfig.mode = "nvme" needs path (a directory on node-local disk)'
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"OffloadConfig.bucket_mb must be > 0, got {self.bucket_mb}")

    def build(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        rank: int,
    ) -> Any:
        """miles_offload.AdamW over ``params`` for mode "cpu" or "nvme".

        Raises:
            ImportError: miles-offload is not installed (the message names the pip command).
        """
        assert self.mode in ("cpu", "nvme"), "mode 'none' uses torch's AdamW"
        try:
            import miles_offload  # pants: no-infer-dep (optional extra; tests depend on its wheel)
        except ImportError as exc:
            raise ImportError(
                f'trainer.offload.mode = "{self.mode}" needs the miles-offload package: '
                "pip install miles-offload (or pip install 'miles-trainer[offload]')"
            ) from exc
        path = None
        if self.mode == "nvme":
            assert self.path is not None
            path = os.path.join(self.path, f"rank{rank}")
        return miles_offload.AdamW(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            offload=self.mode,
            path=path,
            bucket_mb=self.bucket_mb,
            # The trainer's checkpoints (load_state_dict) are the optimizer's record; the NVMe
            # directory is working space, refilled at every start.
            overwrite=True,
        )


@dataclass(kw_only=True, slots=True)
class ReferenceConfig:
    """The frozen reference model of the KL term (loaded only when ``loss.kl_coef > 0``).

    It has no ``build()``: each backend loads it in its own layout, beside the policy.

    Attributes:
        path: reference model directory; None means the policy's ``model_path``.
        placement: "device" (the policy's layout: sharded over the ranks with FSDP2, on the
            accelerator) or "cpu" (a full copy in host memory on every rank, its forward on
            the CPU: no accelerator memory, at the cost of CPU compute).
    """

    path: str | None = None
    placement: str = "device"

    def __post_init__(self) -> None:
        if self.placement not in REF_PLACEMENTS:
            raise ValueError(
                f"ReferenceConfig.placement must be one of {REF_PLACEMENTS}, got {self.placement!r}"
            )


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """PPO's critic: a value head on a transformer backbone, trained beside the policy.

    The critic is the backbone of ``model_path`` (the causal LM without its LM head) plus a
    linear head to one value, initialised to zero. Its value for response token ``t`` is read
    at the position that predicts ``t`` (the state before the token). Needed by
    ``advantage.estimator: gae``.

    Attributes:
        model_path: backbone directory; None means the policy's ``model_path``.
        lr: the critic's AdamW learning rate (other AdamW settings are the policy's). >= 0.
        value_clip: clip of the value update in the loss (`value_loss`); None disables it. > 0.
        grad_clip: the critic's gradient 2-norm clip; None disables it. > 0.
    """

    model_path: str | None = None
    lr: float = 1e-5
    value_clip: float | None = 0.2
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        if not (self.lr >= 0.0 and math.isfinite(self.lr)):
            raise ValueError(f"CriticConfig.lr must be finite and >= 0, got {self.lr}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"CriticConfig.value_clip must be None or > 0, got {self.value_clip}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"CriticConfig.grad_clip must be None or > 0, got {self.grad_clip}")

    def build(self, policy_model_path: str, *, attn_implementation: str = "sdpa") -> Any:
        """The critic module (`miles_trainer.critic.ValueModel`), float32, on the CPU."""
        from miles_trainer.critic import ValueModel

        path = self.model_path or policy_model_path
        what = "trainer.critic.model_path" if self.model_path else "model_path"
        return ValueModel.from_pretrained(path, what, attn_implementation=attn_implementation)


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Everything a trainer needs; ``backend`` picks which one `build` makes.

    Attributes:
        model_path: local Hugging Face model directory (config.json plus safetensors weights).
        dtype: compute dtype of the forward/backward: "float32", "bfloat16" or "float16".
            Parameters, gradients and optimizer state stay float32 (FSDP2 mixed precision
            casts the all-gathered parameters; gradients are reduced in float32).
        lr: AdamW learning rate: the peak of the schedule below (constant by default). >= 0.
        lr_warmup_steps: optimizer steps of linear warm-up from ``lr / lr_warmup_steps`` to
            ``lr``. >= 0.
        lr_decay_style: after the warm-up, "constant" (``lr``), "linear" or "cosine" (from
            ``lr`` down to ``min_lr`` over ``lr_decay_steps``, then ``min_lr``).
        lr_decay_steps: optimizer steps of the decay; None with a decay style asks the caller
            to set it (`miles train` sets ``run.num_steps x num_minibatches`` minus the
            warm-up). >= 1.
        min_lr: where the decay ends. 0 <= min_lr <= lr.
        weight_decay: AdamW decoupled weight decay. >= 0.
        betas: AdamW (beta1, beta2), each in [0, 1).
        eps: AdamW epsilon. > 0.
        grad_clip: clip the global gradient 2-norm to this value before each optimizer step;
            None disables clipping (the norm is still reported). > 0.
        micro_batch_size: samples per forward/backward pass on one rank. >= 1.
        max_tokens_per_microbatch: if set, micro-batches are cut by a token budget instead of
            ``micro_batch_size``: samples are added while the micro-batch's tokens (with
            ``packing``: the sum of the sample lengths; without: samples x the longest) stay
            within it; a longer sample goes alone. >= 1.
        packing: run each micro-batch as one packed row (the samples back to back, positions
            restarting per sample, attention kept within each sample) instead of right-padded
            rows: no compute on padding. Same loss and gradients as padded within fp32
            rounding.
        num_minibatches: optimizer steps per `train_step`; the batch is split into this many
            contiguous mini-batches. >= 1.
        temperature: logits are divided by it before log-softmax, matching the rollout
            logprob contract (a greedy rollout, temperature 0, is scored at 1.0). > 0.
        loss: the RL loss.
        advantage: how rewards become advantages (computed by the trainer).
        critic: PPO's value model; required by ``advantage.estimator: gae``, else None.
        reference: the reference model of the KL term.
        on_nonfinite: what a non-finite loss or gradient norm does: "skip" (that optimizer
            step is skipped, the weights and optimizer state stay as they were, and
            ``skipped_steps`` counts it) or "stop" (raise `NonFiniteError`, weights untouched).
        seed: torch RNG seed set at construction.
        offload: where the optimizer state lives (`OffloadConfig`).
        qat: INT4 quantization-aware training of the policy (not the reference model); None
            trains in plain precision. Needs miles-quant (``pip install 'miles-trainer[quant]'``).
        fsdp: settings only the FSDP2 backend reads.
        megatron: settings only the Megatron backend reads (TP / PP / EP layout, ...).
        backend: "fsdp" (`FSDPTrainer`: PyTorch FSDP2) or "megatron" (`MegatronTrainer`:
            megatron-core). Both take the same `TrainBatch` and use the same loss hub.
        r3: rollout routing replay for MoE models: every forward of a train step (policy and
            reference) routes each token to the experts recorded at rollout
            (``TrainBatch.routed_experts``, required then) instead of the router's own top-k;
            the gate weights stay the router's probabilities of those experts. Needs an MoE
            model (HF Qwen3-MoE on FSDP2, megatron-core MoE on Megatron).
        deterministic: deterministic kernels (``torch.use_deterministic_algorithms``; on CUDA
            also ``CUBLAS_WORKSPACE_CONFIG``), set when the trainer is built. A run's own
            ``run.deterministic`` sets it: with the same seeds, inputs and rank count, a run
            resumed from a checkpoint then matches the uninterrupted one bit for bit.
    """

    model_path: str
    dtype: str = "float32"
    lr: float = 1e-5
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    micro_batch_size: int = 8
    max_tokens_per_microbatch: int | None = None
    packing: bool = False
    num_minibatches: int = 1
    temperature: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    critic: CriticConfig | None = None
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    on_nonfinite: str = "skip"
    seed: int = 0
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    qat: QATConfig | None = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    backend: str = "fsdp"
    r3: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("TrainerConfig.model_path must name a Hugging Face model directory")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"TrainerConfig.backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainerConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.lr >= 0.0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainerConfig.lr must be finite and >= 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ValueError(
                f"TrainerConfig.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"TrainerConfig.lr_decay_style must be one of {LR_DECAY_STYLES}, got "
                f"{self.lr_decay_style!r}"
            )
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise ValueError(
                f"TrainerConfig.lr_decay_steps must be None or >= 1, got {self.lr_decay_steps}"
            )
        if not (0.0 <= self.min_lr <= self.lr):
            raise ValueError(
                f"TrainerConfig.min_lr must be in [0, lr={self.lr}], got {self.min_lr}"
            )
        if not self.weight_decay >= 0.0:
            raise ValueError(f"TrainerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainerConfig.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0.0:
            raise ValueError(f"TrainerConfig.eps must be > 0, got {self.eps}")
        if self.grad_clip is not None and not self.grad_clip > 0.0:
            raise ValueError(f"TrainerConfig.grad_clip must be None or > 0, got {self.grad_clip}")
        if self.micro_batch_size < 1:
            raise ValueError(
                f"TrainerConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}"
            )
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(
                f"TrainerConfig.max_tokens_per_microbatch must be None or >= 1, got "
                f"{self.max_tokens_per_microbatch}"
            )
        if self.num_minibatches < 1:
            raise ValueError(
                f"TrainerConfig.num_minibatches must be >= 1, got {self.num_minibatches}"
            )
        if self.advantage.needs_values and self.critic is None:
            raise ValueError(
                'TrainerConfig.advantage.estimator "gae" needs a critic: set trainer.critic '
                "(e.g. critic: {lr: 1e-5})"
            )
        if self.critic is not None and not self.advantage.needs_values:
            raise ValueError(
                f"TrainerConfig.critic is set but advantage.estimator is "
                f"{self.advantage.estimator!r}, which does not use values: set estimator: gae "
                "or remove the critic"
            )
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"TrainerConfig.on_nonfinite must be one of {NONFINITE_POLICIES}, got "
                f"{self.on_nonfinite!r}"
            )
        if not (self.temperature > 0.0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"TrainerConfig.temperature must be finite and > 0 (score a greedy rollout at "
                f"1.0), got {self.temperature}"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0 for the first one; skipped steps do
        not count), per ``lr`` and the ``lr_*`` / ``min_lr`` schedule.

        Raises:
            ValueError: a decay style without ``lr_decay_steps``.
        """
        if step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.lr
        if self.lr_decay_steps is None:
            raise ValueError(
                f"trainer.lr_decay_style {self.lr_decay_style!r} needs trainer.lr_decay_steps "
                "(miles train sets it from run.num_steps)"
            )
        t = min(step - self.lr_warmup_steps, self.lr_decay_steps) / self.lr_decay_steps
        if self.lr_decay_style == "linear":
            frac = 1.0 - t
        else:
            frac = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.min_lr + (self.lr - self.min_lr) * frac

    def build(self) -> Trainer:
        """The trainer of ``backend``, constructed (collective: every rank calls it).

        Raises:
            ImportError: the backend's optional dependency is missing (the message names the
                ``pip install``).
        """
        if self.backend == "fsdp":
            from miles_trainer.fsdp.trainer import FSDPTrainer

            return FSDPTrainer(self)
        from miles_trainer.megatron.trainer import MegatronTrainer  # imports megatron-core

        trainer: Trainer = MegatronTrainer(self)
        return trainer
