"""`MegatronTrainer`: megatron-core's GPTModel (TP / PP / EP / SP, distributed optimizer)
trained with the shared RL loss hub, behind the same contract as `FSDPTrainer`.

Every rank calls every method with the same arguments (they are collective). Run one process
(TP = PP = EP = 1) or ``torchrun --nproc_per_node N``; gloo on CPU (through `cpu_compat`),
NCCL on CUDA.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_trainer._distributed import broadcast_ok, init_distributed
from miles_trainer._hf_dir import check_model_dir, write_hf_dir
from miles_trainer._lr import set_lr
from miles_trainer._metrics import StepMetrics, token_mean, version_metrics
from miles_trainer.advantages import batch_advantages, shape_and_filter
from miles_trainer.batch import MicroBatch, TrainBatch, make_micro_batch, plan_micro_batches
from miles_trainer.checkpoint import (
    CheckpointInfo,
    check_compatible,
    load_common,
    read_meta,
    set_deterministic,
    write_checkpoint,
)
from miles_trainer.config import TrainerConfig
from miles_trainer.losses import MAX_SUFFIX, MIN_SUFFIX
from miles_trainer.megatron import cpu_compat, train_state
from miles_trainer.megatron.checkpoint import iter_hf_tensors
from miles_trainer.megatron.convert import ModelDims, stack_experts, te_name, unstack_experts
from miles_trainer.megatron.logprobs import vocab_parallel_response_logprobs
from miles_trainer.megatron.optim import (
    apply_step,
    build_optimizer,
    grad_norm,
    load_optimizer_state,
    optimizer_state,
)
from miles_trainer.megatron.parallelize import (
    build_model,
    init_model_parallel,
    load_hf_weights,
    ps,
    rank_coords,
    wrap_ddp,
)
from miles_trainer.megatron.r3 import MegatronRouting
from miles_trainer.trainer import NonFiniteError

__all__ = ["MegatronTrainer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Micro:
    """One forward/backward of one data-parallel replica; ``real`` False is a zero-weight
    filler pass (so that every replica runs the same number of micro-batches)."""

    mb: MicroBatch
    real: bool
    key: tuple[int, int]  # (mini-batch, micro-batch)
    shape: tuple[int, int] | None = None  # pad the model input to (B, L); None: its own


def _minibatch_indices(n: int, num_minibatches: int) -> list[list[int]]:
    q, r = divmod(n, num_minibatches)
    out, start = [], 0
    for k in range(num_minibatches):
        size = q + (1 if k < r else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def _one_shape(micros: list[_Micro], mcfg: Any = None) -> list[_Micro]:
    """Give micro-batches that are padded (``shape`` set, or ``mcfg`` given) one common shape:
    the largest; a pipeline's buffers have one shape for a whole schedule."""
    if mcfg is not None:
        tp = mcfg.tp if mcfg.sequence_parallel else 1
        for m in micros:
            B, L = m.mb.input_ids_BL.shape
            m.shape = (B, -(-L // tp) * tp)
    shapes = [m.shape for m in micros if m.shape is not None]
    if shapes:
        common = (max(B for B, _ in shapes), max(L for _, L in shapes))
        for m in micros:
            m.shape = common
    return micros


def _load_hf_state(path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(HF config, fp32 state in checkpoint names) of a model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = dict(unstack_experts(model.state_dict().items()))
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return config, state


class MegatronTrainer:
    """Policy trainer: megatron-core GPTModel + Megatron DDP + its (distributed) optimizer.

    Construction joins (or creates) the default process group, builds Megatron's TP / PP / EP
    groups from ``config.megatron``, converts the HF weights of ``config.model_path`` into this
    rank's shards (`convert.py`) and wraps the stage in megatron-core's DDP. The data-parallel
    size is ``world / (tp * pp)``; data-parallel replica d trains on samples ``d::dp`` of each
    mini-batch, exactly as `FSDPTrainer`'s ranks do, so both give the gradient of the whole
    mini-batch. Token logprobs come from vocab-parallel logits (`logprobs.py`).

    Args:
        config: the trainer configuration (``config.megatron`` holds the layout).

    Raises:
        ValueError: the layout does not fit the world size or the model, or the config asks
            for something this backend does not do (named).
        ImportError: megatron-core is not installed.
    """

    def __init__(self, config: TrainerConfig) -> None:
        for unsupported, what in (
            (config.qat is not None, "trainer.qat (INT4 QAT)"),
            (config.critic is not None, "trainer.critic (PPO's value model)"),
            (
                config.offload.mode != "none",
                "trainer.offload (its distributed optimizer shards the optimizer state instead)",
            ),
        ):
            if unsupported:
                raise ValueError(
                    f"{what} is not supported by the Megatron backend; use backend: fsdp"
                )
        if config.reference.placement == "cpu" and torch.cuda.is_available():
            raise ValueError(
                'trainer.reference.placement "cpu" is not supported by the Megatron backend on '
                'a GPU (the reference is sharded like the policy); use placement: "device"'
            )
        if config.packing:
            warnings.warn(
                "trainer.packing: the Megatron backend runs the same micro-batches padded "
                "(packed attention needs Transformer Engine's THD kernels); the loss and "
                "gradients are the same within fp32 rounding",
                stacklevel=2,
            )
        self.config = config
        mcfg = config.megatron
        check_model_dir(config.model_path)
        self._rank, self._world, self._device = init_distributed()
        if config.deterministic:
            set_deterministic(self._device)
        torch.manual_seed(config.seed)
        self._dp = init_model_parallel(mcfg, self._world, config.seed)
        self._par = rank_coords(mcfg)
        hf_config, full = _load_hf_state(config.model_path)
        self._hf_config = hf_config
        self._dims = ModelDims.from_hf_config(
            hf_config, vocab_multiple=mcfg.make_vocab_size_divisible_by * mcfg.tp
        )
        self._te = mcfg.transformer_impl == "transformer_engine"
        with cpu_compat.quiet_megatron():
            built = build_model(hf_config, self._dims, mcfg, config.dtype)
        load_hf_weights(built.module, full, self._dims, self._par, te=self._te)
        del full
        self._module = built.module
        self._tcfg = built.config
        self._ddp = wrap_ddp(built, mcfg)
        self._ref: torch.nn.Module | None = None
        if config.loss.kl_coef > 0:
            ref_path = config.reference.path or config.model_path
            _, ref_full = _load_hf_state(ref_path)
            with cpu_compat.quiet_megatron():
                ref = build_model(hf_config, self._dims, mcfg, config.dtype)
            load_hf_weights(ref.module, ref_full, self._dims, self._par, te=self._te)
            ref.module.requires_grad_(False)
            self._ref = ref.module.eval()
        # R3 (megatron/r3.py): routers of the policy and the reference replay batch records.
        self._r3 = MegatronRouting.build(
            config, hf_config, [self._module, self._ref], tp_rank=self._par.tp_rank
        )
        self._module.eval()  # dropout is off anyway; eval keeps HF-equal numerics explicit
        self._optimizer = build_optimizer(config, [self._ddp])
        # Optimizer steps applied so far: the learning-rate schedule's position (checkpointed).
        self._optimizer_steps = 0
        if config.dtype == "float16":
            self._tcfg.grad_scale_func = self._optimizer.scale_loss
        self._loss_fn = config.loss.build()
        self._dp_rank = ps.get_data_parallel_rank()
        # The rank whose metrics and logprobs every rank adopts: data-parallel replica 0's
        # TP rank 0 on the last pipeline stage.
        # Pipeline stages and megatron's MoE all-gather dispatcher exchange activations of one
        # shape across ranks; other layouts run each micro-batch at its own size.
        self._fixed_shapes = mcfg.pp > 1 or bool(self._dims.num_experts and mcfg.ep * mcfg.etp > 1)
        self._reports_replica = ps.is_pipeline_last_stage() and self._par.tp_rank == 0
        self._reports = self._reports_replica and self._dp_rank == 0
        self._src = 0
        if self._world > 1:
            who = torch.tensor([self._rank if self._reports else -1], device=self._device)
            dist.all_reduce(who, op=dist.ReduceOp.MAX)
            self._src = int(who.item())

    # ------------------------------------------------------------------ properties

    @property
    def model(self) -> torch.nn.Module:
        """This rank's megatron-core GPTModel stage (Megatron names, local shards).

        For HF-named full tensors use `named_hf_tensors`.
        """
        return self._module

    @property
    def rank(self) -> int:
        """This process's rank in the default group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks (tp x pp x dp)."""
        return self._world

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self._device

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel replicas."""
        return self._dp

    # ------------------------------------------------------------------ weights out

    def _local(self, grads: bool) -> Any:
        params = dict(self._module.named_parameters())
        moe = bool(self._dims.num_experts)

        def get(name: str) -> torch.Tensor:
            p = params[te_name(name, moe=moe) if self._te else name]
            return p.main_grad if grads else p.detach()

        return get

    def named_hf_tensors(
        self, *, stacked_experts: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The full policy weights under HF names, one tensor at a time, on every rank.

        **Collective**: every rank must run the iterator to the end, in step (the TP / EP
        gathers and the pipeline broadcasts happen as it advances). Feed it to
        ``miles_transfer.push_weights`` on the sending rank and drain it on the others.

        Args:
            stacked_experts: MoE experts as transformers holds them in memory
                (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``)
                instead of per-expert checkpoint names; tied models then also yield
                ``lm_head.weight`` (the names of ``model.state_dict()`` of the HF module).

        Yields:
            ``(name, tensor)``: dense tensors in the compute dtype, on ``device``.
        """
        stream = iter_hf_tensors(
            self._local(False),
            self._dims,
            self._par,
            dtype=self._tcfg.params_dtype,
            device=self._device,
        )
        if not stacked_experts:
            yield from stream
            return
        for name, t in stack_experts(stream, self._dims.num_experts):
            yield name, t
            if name == "model.embed_tokens.weight" and self._dims.tie:
                yield "lm_head.weight", t

    def named_hf_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The gradients of the last optimizer step (after clipping) under HF names, full,
        float32, on every rank; collective like `named_hf_tensors`. With the distributed
        optimizer over several data-parallel replicas only the reduced shards are final, so
        this needs one replica or ``distributed_optimizer: false``.

        Raises:
            ValueError: several replicas with the distributed optimizer.
        """
        if self._dp > 1 and self.config.megatron.distributed_optimizer:
            raise ValueError(
                "named_hf_grads needs one data-parallel replica or distributed_optimizer: false"
            )
        return iter_hf_tensors(
            self._local(True), self._dims, self._par, dtype=torch.float32, device=self._device
        )

    def megatron_shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (views, no copy, no collective) under Transformer Engine
        names: the local tensors miles-transfer's ``megatron_layout`` describes for this rank,
        for P2P re-sharding straight from the trainer's layout. Build that layout with
        `megatron_layout_args` and ``ModelShape.from_hf_config(trainer.hf_config, dtype=...)``
        (the default ``make_vocab_size_divisible_by`` of 128, which the layout assumes)."""
        moe = bool(self._dims.num_experts)
        return {
            (n if self._te else te_name(n, moe=moe)): p.detach()
            for n, p in self._module.named_parameters()
        }

    def megatron_layout_args(self) -> dict[str, int]:
        """``megatron_layout``'s keyword arguments for this job: tp, pp, dp, ep, etp (global
        rank r is that layout's rank r: TP fastest, then data parallel, then pipeline)."""
        m = self.config.megatron
        return {"tp": m.tp, "pp": m.pp, "dp": self._dp, "ep": m.ep, "etp": m.etp}

    @property
    def hf_config(self) -> Any:
        """The HF config of the policy (``config.json`` of ``model_path``)."""
        return self._hf_config

    # ------------------------------------------------------------------ batches

    def _check_tokens(self, batch: TrainBatch) -> None:
        vocab = self._dims.vocab
        for i, toks in enumerate(batch.tokens):
            top = max(toks)
            if top >= vocab:
                raise ValueError(
                    f"{batch.name(i)}: token id {top} is out of range for the model's "
                    f"vocabulary of {vocab}"
                )

    def _check_same_batch(self, batch: TrainBatch) -> None:
        if self._world == 1:
            return
        fp = [
            len(batch),
            sum(map(len, batch.tokens)),
            sum(batch.response_lengths),
            batch.num_loss_tokens(),
            sum(sum(t) for t in batch.tokens),
        ]
        t = torch.tensor(fp + [-x for x in fp], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if not torch.equal(t[: len(fp)], -t[len(fp) :]):
            raise ValueError(
                "train_step got different batches on different ranks; every rank must pass the "
                "same TrainBatch (each data-parallel replica takes its own share of it)"
            )

    def _plan(self, batch: TrainBatch, share: list[int]) -> list[list[int]]:
        cfg = self.config
        return plan_micro_batches(
            [len(t) for t in batch.tokens],
            share,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_microbatch,
            packed=cfg.packing,
        )

    def _micro_batches(self, batch: TrainBatch, indices: list[int], k: int) -> list[_Micro]:
        """This replica's micro-batches of mini-batch ``k``; equally many on every replica.

        Replica d takes samples ``indices[d::dp]``, cut by `plan_micro_batches` (as
        `FSDPTrainer` cuts a rank's share). Replicas with fewer micro-batches run zero-weight
        filler passes, so that every replica runs the same schedule.
        """
        plans = [self._plan(batch, indices[d :: self._dp]) for d in range(self._dp)]
        mine = plans[self._dp_rank]
        out = []
        for j in range(max(len(p) for p in plans)):
            chunk = mine[j] if j < len(mine) else indices[:1]
            out.append(_Micro(make_micro_batch(batch, chunk, self._device), j < len(mine), (k, j)))
        if self._fixed_shapes:
            # Every rank pads to the largest micro-batch of any replica: pipeline stages and
            # the MoE all-gather exchange tensors of one shape.
            chunks = [c for p in plans for c in p]
            tp = self.config.megatron.tp if self.config.megatron.sequence_parallel else 1
            longest = max(len(batch.tokens[i]) for c in chunks for i in c)
            shape = (max(map(len, chunks)), -(-longest // tp) * tp)
            for m in out:
                m.shape = shape
        return out

    # ------------------------------------------------------------------ forward

    def _model_inputs(
        self, mb: MicroBatch, shape: tuple[int, int] | None
    ) -> tuple[torch.Tensor, ...]:
        """GPTModel's inputs: ids right-padded to ``shape`` (pipeline stages exchange fixed
        shapes) or to a multiple of tp (sequence parallelism splits the sequence), positions,
        and the causal mask. Padding sits after every real token and row, so a causal model's
        outputs at real positions do not change."""
        ids_BL = mb.input_ids_BL
        B, L = ids_BL.shape
        tp = self.config.megatron.tp if self.config.megatron.sequence_parallel else 1
        B2, L2 = shape if shape is not None else (B, -(-L // tp) * tp)
        if (B2, L2) != (B, L):
            ids_BL = torch.nn.functional.pad(ids_BL, (0, L2 - L, 0, B2 - B))
            B, L = B2, L2
        pos_BL = torch.arange(L, device=ids_BL.device).expand(B, L)
        # True = masked (megatron's convention); passed explicitly so that no default mask
        # is built on CUDA.
        mask_11LL = torch.ones(L, L, dtype=torch.bool, device=ids_BL.device).triu(1)[None, None]
        return ids_BL, pos_BL, mask_11LL

    def _logprobs(
        self, logits_BLv: torch.Tensor, mb: MicroBatch, *, with_entropy: bool, grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, L, v = logits_BLv.shape
        # MicroBatch.logit_pos_BR indexes the flattened [B0 * L0, V] logits of the unpadded
        # micro-batch; re-base it when `_model_inputs` padded (extra rows come last).
        L0 = mb.input_ids_BL.shape[1]
        pos_BR = mb.logit_pos_BR
        if L != L0:
            pos_BR = (pos_BR // L0) * L + pos_BR % L0
        flat_1Nv = logits_BLv.reshape(1, B * L, v)
        logp_1N, ent_1N = vocab_parallel_response_logprobs(
            flat_1Nv,
            pos_BR.reshape(1, -1),
            mb.targets_BR.reshape(1, -1),
            self.config.temperature,
            vocab_size=self._dims.vocab,
            with_entropy=with_entropy,
            entropy_grad=grad,
        )
        shape = mb.targets_BR.shape
        return logp_1N.view(shape), None if ent_1N is None else ent_1N.view(shape)

    def _forward_step(self, handler: Any, data_iterator: Iterator[_Micro], model: Any) -> Any:
        micro = next(data_iterator)
        ids_BL, pos_BL, mask_11LL = self._model_inputs(micro.mb, micro.shape)
        routing = self._r3.forward(micro.mb, tuple(ids_BL.shape), real=micro.real)
        with cpu_compat.outside_cpu_scope(), routing:
            out = model(ids_BL, pos_BL, mask_11LL)
        return out, partial(handler, micro)

    def _run(self, model: Any, micros: list[_Micro], handler: Any, *, forward_only: bool) -> None:
        """Megatron's pipeline schedule over ``micros``; ``handler(micro, logits)`` runs on
        the last stage and returns ``(loss, info)``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shapes = [m.shape or tuple(m.mb.input_ids_BL.shape) for m in micros]
        with cpu_compat.cpu_scope(), cpu_compat.quiet_megatron():
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, handler),
                data_iterator=iter(micros),
                model=[model],
                num_microbatches=len(micros),
                # With pipeline stages every micro-batch has this one (padded) shape.
                seq_length=max(L for _, L in shapes),
                micro_batch_size=max(B for B, _ in shapes),
                forward_only=forward_only,
            )

    def _logprob_pass(
        self, model: Any, micros: list[_Micro]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """No-grad logprobs of every micro-batch, keyed by (mini-batch, micro-batch); filled
        on the last pipeline stage."""
        out: dict[tuple[int, int], torch.Tensor] = {}

        def handler(micro: _Micro, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, _ = self._logprobs(logits, micro.mb, with_entropy=False, grad=False)
            out[micro.key] = logp
            return logits.new_zeros(()), {}

        with torch.no_grad():
            self._run(model, micros, handler, forward_only=True)
        return out

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def compute_logprobs(
        self, tokens: list[list[int]], response_lengths: list[int]
    ) -> list[list[float]]:
        """Teacher-forced response logprobs under the current policy (the rollout contract):
        ``log_softmax(float32(logits) / temperature)[token]``. Collective; every rank returns
        the same lists.

        Args:
            tokens: prompt + response ids per sample.
            response_lengths: response length per sample.

        Returns:
            Per sample, ``response_length`` logprobs.
        """
        batch = TrainBatch(
            tokens=tokens,
            response_lengths=response_lengths,
            loss_masks=[[0] * r for r in response_lengths],
            rollout_logprobs=[[0.0] * r for r in response_lengths],
            advantages=[[0.0] * r for r in response_lengths],
        )
        self._check_tokens(batch)
        micros = [
            _Micro(make_micro_batch(batch, chunk, self._device), True, (0, j))
            for j, chunk in enumerate(self._plan(batch, list(range(len(batch)))))
        ]
        if self._fixed_shapes:
            micros = _one_shape(micros, self.config.megatron)
        logp = self._logprob_pass(self._module, micros)
        rows: list[list[float]] = []
        if self._reports:
            for m in micros:
                rows.extend(m.mb.unpad(logp[m.key]))
        return self._from_reporter(rows)

    def _from_reporter(self, value: Any) -> Any:
        if self._world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self._src)
        return box[0]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update: up to ``config.num_minibatches`` optimizer steps over ``batch``.

        The contract and metrics of ``FSDPTrainer.train_step``: the batch is shaped and
        filtered (``config.advantage``) and cut into contiguous mini-batches; in each,
        data-parallel replica d trains on samples ``d::dp`` in micro-batches (megatron's
        schedule, pipelined when ``pp > 1``) with the loss normalised by the mini-batch's
        global counts. No-grad passes before any update give the old logprobs (none with one
        mini-batch: the training forward's own are those) and the reference logprobs; the
        advantages come from the configured estimator. A non-finite loss or gradient norm
        skips the step (or raises `NonFiniteError` with ``on_nonfinite: stop``) with the weights
        untouched.

        Args:
            batch: the samples to train on.

        Returns:
            Metrics, identical on every rank (the README lists them).

        Raises:
            ValueError: fewer samples than ``num_minibatches``, token ids outside the
                vocabulary, different batches on different ranks, or an estimator that cannot
                run on this batch.
            NonFiniteError: a non-finite loss or gradient with ``on_nonfinite = "stop"``.
        """
        cfg, lcfg = self.config, self.config.loss
        if len(batch) < cfg.num_minibatches:
            raise ValueError(
                f"batch has {len(batch)} samples but num_minibatches = {cfg.num_minibatches}; "
                "every optimizer step needs at least one sample"
            )
        self._check_tokens(batch)
        self._r3.check(batch)
        self._check_same_batch(batch)
        prepared, out = shape_and_filter(batch, cfg.advantage)
        if prepared is None:  # the group filter dropped everything: no update this step
            out.update(samples=0.0, tokens=0.0, skipped_steps=0.0, optimizer_steps=0.0)
            return out
        batch = prepared
        out.update(version_metrics(batch))
        n_mb = min(cfg.num_minibatches, len(batch))
        minibatches = _minibatch_indices(len(batch), n_mb)
        micros = [self._micro_batches(batch, idx, k) for k, idx in enumerate(minibatches)]
        flat = _one_shape([m for group in micros for m in group])

        need_old = not lcfg.use_rollout_logprobs
        old_from_train = need_old and n_mb == 1
        old = self._logprob_pass(self._ddp, flat) if need_old and not old_from_train else {}
        ref = self._logprob_pass(self._ref, flat) if self._ref is not None else {}
        adv, _ = batch_advantages(batch, cfg.advantage, None)
        xs = [a for row, mask in zip(adv, batch.loss_masks) for a, m in zip(row, mask) if m]
        if xs:
            out["advantage_mean"] = sum(xs) / len(xs)
            out["advantage_abs_mean"] = sum(map(abs, xs)) / len(xs)
        for m in flat:
            m.mb.advantages_BR = m.mb.per_token(adv)

        # Loss terms are summed on one TP rank of the last stage of each replica.
        metrics = StepMetrics(n_mb) if self._reports_replica else None
        grad_norms: list[float] = []
        skipped = 0
        for k, (idx, group) in enumerate(zip(minibatches, micros)):
            n_tok = max(1, batch.num_loss_tokens(idx))
            counts = {
                "num_global_tokens": n_tok,
                "num_global_seqs": len(idx),
                "norm_length": lcfg.norm_length or max(batch.response_lengths[i] for i in idx),
            }
            # megatron's schedule divides the loss by the micro-batch count and its DDP
            # averages gradients over replicas; the partial sums want neither.
            scale = float(len(group) * self._dp)

            def handler(
                micro: _Micro,
                logits: torch.Tensor,
                k: int = k,
                counts: dict[str, Any] = counts,
                scale: float = scale,
            ) -> tuple[torch.Tensor, dict[str, Any]]:
                mb = micro.mb
                logp_BR, ent_BR = self._logprobs(
                    logits, mb, with_entropy=True, grad=lcfg.entropy_coef > 0
                )
                if old_from_train:
                    old_BR = logp_BR.detach()
                else:
                    old_BR = old[micro.key] if need_old else mb.rollout_logp_BR
                loss, terms = self._loss_fn(
                    logp_BR,
                    old_BR,
                    mb.advantages_BR,
                    mb.mask_BR,
                    ref_logp_BT=ref.get(micro.key),
                    entropy_BT=ent_BR,
                    rollout_logp_BT=mb.rollout_logp_BR,
                    **counts,
                )
                if metrics is not None:
                    train_BR = old_BR if need_old else logp_BR.detach()
                    diff_BR = train_BR - mb.rollout_logp_BR
                    n = counts["num_global_tokens"]
                    terms["loss"] = loss.detach()
                    terms["train_rollout_logprob_abs_diff"] = token_mean(diff_BR.abs(), mb, n)
                    terms["train_rollout_logprob_diff"] = token_mean(diff_BR, mb, n)
                    metrics.add(k, terms, real=micro.real)
                return loss * (scale if micro.real else 0.0), {}

            with cpu_compat.quiet_megatron():
                self._ddp.zero_grad_buffer()
                self._optimizer.zero_grad()
            with self._r3.counting():
                self._run(self._ddp, group, handler, forward_only=False)
            local = metrics.local_sum("loss", k) if metrics is not None else 0.0
            norm = grad_norm(self._optimizer)
            grad_norms.append(norm)
            if self._all_finite(local) and math.isfinite(norm):
                set_lr(self._optimizer, cfg.lr_at(self._optimizer_steps))
                apply_step(self._optimizer, norm)
                self._optimizer_steps += 1
            elif cfg.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"train_step: non-finite loss or gradient in mini-batch {k} (grad_norm "
                    f"{norm}); the step was not applied, the weights are untouched "
                    '(trainer.on_nonfinite: "skip" skips such steps instead)'
                )
            else:
                skipped += 1

        out.update(self._reduce_metrics(metrics))
        out.update(self._r3.metrics(self._device))
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = cfg.lr_at(max(self._optimizer_steps - 1, 0))
        out["samples"] = float(len(batch))
        out["tokens"] = float(batch.num_loss_tokens())
        out["optimizer_steps"] = float(n_mb - skipped)
        out["skipped_steps"] = float(skipped)
        return out

    def _all_finite(self, local: float) -> bool:
        """Whether every replica's loss partial sum is finite (collective)."""
        if self._world == 1:
            return math.isfinite(local)
        flag = torch.tensor([0.0 if math.isfinite(local) else 1.0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def _reduce_metrics(self, metrics: StepMetrics | None) -> dict[str, float]:
        """Every replica's step metrics combined (sums add, ``*_max`` / ``*_min`` take the
        extreme), on every rank."""
        out: dict[str, float] = {}
        if metrics is not None:
            # StepMetrics' local reduction is linear in the partial sums (a mean over
            # mini-batches), so adding the replicas' results equals reducing their sums.
            local = metrics.reduce(self._device, 1)
            parts: list[Any] = [local]
            if self._dp > 1:
                parts = [None] * self._dp
                dist.all_gather_object(parts, local, group=ps.get_data_parallel_group())
            for part in parts:
                for name, v in part.items():
                    if name not in out:
                        out[name] = v
                    elif name.endswith(MAX_SUFFIX):
                        out[name] = max(out[name], v)
                    elif name.endswith(MIN_SUFFIX):
                        out[name] = min(out[name], v)
                    else:
                        out[name] += v
        result: dict[str, float] = self._from_reporter(out)
        return result

    # ------------------------------------------------------------------ checkpoints

    def save_hf_checkpoint(self, path: str | os.PathLike[str], *, dtype: str | None = None) -> None:
        """Gather the full weights and write an HF model directory from rank 0. Collective.

        The same directory as ``FSDPTrainer.save_hf_checkpoint`` writes (config, safetensors
        in checkpoint names, generation config, tokenizer files), atomically.

        Raises:
            ValueError: an unknown dtype.
            RuntimeError: on ranks other than 0 when rank 0 failed to write.
        """
        name = dtype or self.config.dtype
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {name!r}")
        state = {n: t.cpu() for n, t in self.named_hf_tensors()}
        error: BaseException | None = None
        if self._rank == 0:
            try:
                write_hf_dir(
                    path,
                    state,
                    config=self._hf_config,
                    generation_config=None,
                    source_dir=self.config.model_path,
                    dtype=_DTYPES[name],
                )
            except BaseException as e:  # reported to the other ranks, then re-raised
                error = e
        ok = broadcast_ok(error is None, self._device) if self._world > 1 else error is None
        if error is not None:
            raise error
        if not ok:
            raise RuntimeError(f"rank 0 failed to write the checkpoint {os.fspath(path)!r}")

    def save_checkpoint(
        self, path: str | os.PathLike[str], *, step: int, client_state: Any = None
    ) -> None:
        """Write the whole training state to ``path`` atomically (``FSDPTrainer``'s contract;
        layout in `miles_trainer.checkpoint`, files in ``megatron/train_state.py``). Collective.
        """
        with_optimizer = train_state.has_state(self._optimizer)
        write_checkpoint(
            path,
            device=self._device,
            backend="megatron",
            step=step,
            hf_config=self._hf_config,
            source_dir=self.config.model_path,
            layout=self._layout(),
            extra_meta={
                "dtype": self.config.dtype,
                "optimizer_state": with_optimizer,
                "optimizer_steps": self._optimizer_steps,
            },
            client_state=client_state,
            write_state=lambda tmp: train_state.save_rank(
                tmp / train_state.SUBDIR,
                rank=self._rank,
                dp_rank=self._dp_rank,
                layout=self._par,
                module=self._module,
                optimizer=self._optimizer,
                with_optimizer=with_optimizer,
            ),
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Restore what `save_checkpoint` wrote (same model and layout). Collective.

        Raises:
            CheckpointError: a torn checkpoint, or one of another backend, model or layout.
        """
        meta = read_meta(path)
        check_compatible(
            meta, path, backend="megatron", hf_config=self._hf_config, layout=self._layout()
        )
        train_state.load_rank(
            Path(path) / train_state.SUBDIR,
            rank=self._rank,
            layout=self._par,
            module=self._module,
            optimizer=self._optimizer,
            with_optimizer=bool(meta["optimizer_state"]),
        )
        self._optimizer_steps = int(meta.get("optimizer_steps", 0))
        return load_common(path, meta)

    def _layout(self) -> dict[str, Any]:
        m = self.config.megatron
        names = ("tp", "pp", "ep", "etp", "distributed_optimizer", "transformer_impl")
        layout: dict[str, Any] = {n: getattr(m, n) for n in names}
        layout["make_vocab_size_divisible_by"] = m.make_vocab_size_divisible_by
        layout["dp"] = self._dp
        return layout

    def state_dict(self) -> dict[str, Any]:
        """This rank's model shards and optimizer state for resuming (Megatron names; copies).

        Save one file per rank; load it into a trainer of the same config and layout with
        `load_state_dict`.
        """
        model = {n: p.detach().clone() for n, p in self._module.named_parameters()}
        return {
            "model": model,
            "optimizer": optimizer_state(self._optimizer),
            "layout": self._par,
            "optimizer_steps": self._optimizer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned on this rank (values copied). Collective.

        Raises:
            ValueError: the state comes from another layout rank.
        """
        if state.get("layout") != self._par:
            raise ValueError(
                f"state of layout rank {state.get('layout')} cannot load into {self._par}"
            )
        with torch.no_grad():
            for n, p in self._module.named_parameters():
                p.copy_(state["model"][n])
        load_optimizer_state(self._optimizer, state["optimizer"])
        self._optimizer_steps = int(state.get("optimizer_steps", 0))
