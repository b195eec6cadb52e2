"""`FSDPTrainer`: an HF causal LM sharded with FSDP2, trained with the loss hub.

Every rank calls every method with the same arguments (they are collective). Run one process
for a single device, or ``torchrun --nproc_per_node N`` for N (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from miles_trainer._distributed import broadcast_ok, init_distributed
from miles_trainer._hf_dir import write_hf_dir
from miles_trainer._lr import set_lr
from miles_trainer._malloc import keep_freed_memory
from miles_trainer._metrics import StepMetrics, token_mean, version_metrics
from miles_trainer.advantages import batch_advantages, shape_and_filter
from miles_trainer.batch import MicroBatch, TrainBatch, make_micro_batch, plan_micro_batches
from miles_trainer.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    check_compatible,
    load_common,
    read_meta,
    set_deterministic,
    write_checkpoint,
)
from miles_trainer.config import TrainerConfig
from miles_trainer.fsdp import train_state
from miles_trainer.fsdp.checkpoint import gather_full_state_dict
from miles_trainer.fsdp.optim import build_optimizer
from miles_trainer.fsdp.parallelize import PlacedModel, load_model
from miles_trainer.logprobs import response_logprobs
from miles_trainer.losses import value_loss
from miles_trainer.ops import attn_implementation, use_fast_ops
from miles_trainer.r3 import RoutingReplay, hf_moe_dims, install_hf, routed_hf_order
from miles_trainer.trainer import NonFiniteError

__all__ = ["FSDPTrainer"]

# The Megatron backend imports these two from here; they live in _metrics (shared).
_token_mean = token_mean
_version_metrics = version_metrics

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Micro:
    """One forward/backward of one rank; ``real`` False is a zero-weight filler pass."""

    mb: MicroBatch
    real: bool


def _minibatch_indices(n: int, num_minibatches: int) -> list[list[int]]:
    """Sample indices of each mini-batch (contiguous, sizes differing by at most one)."""
    q, r = divmod(n, num_minibatches)
    out, start = [], 0
    for k in range(num_minibatches):
        size = q + (1 if k < r else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


class FSDPTrainer:
    """Policy trainer: HF causal LM + FSDP2 + AdamW + the loss hub.

    Construction initialises ``torch.distributed`` when needed (env:// under a launcher, else a
    one-process group) and loads ``config.model_path`` in float32 on every rank. With several
    ranks, each decoder layer and the root are sharded with FSDP2 ``fully_shard`` over a 1-D
    ``("dp",)`` mesh. With one rank the model stays a plain module (FSDP2 would shard nothing
    and only add overhead) and low-precision compute casts copies of the fp32 parameters the
    way FSDP2's mixed precision does (see ``fsdp/parallelize.py``). With
    ``config.loss.kl_coef > 0`` a frozen reference model is loaded (laid out like the policy,
    or kept on the CPU); with ``config.critic`` a value model is trained beside the policy.

    Args:
        config: the trainer configuration.

    Raises:
        FileNotFoundError: a model directory is missing, or holds no config/safetensors weights.
        ValueError: a user loss or estimator named in the config does not import.
    """

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self._loss_fn = config.loss.build()  # fails early on a user loss that does not import
        config.advantage.build()
        self._rank, self._world, self._device = init_distributed()
        if config.deterministic:
            set_deterministic(self._device)
        self._mesh = init_device_mesh(self._device.type, (self._world,), mesh_dim_names=("dp",))
        torch.manual_seed(config.seed)
        dtype = _DTYPES[config.dtype]
        attn = attn_implementation(dtype, self._device)
        cpu = torch.device("cpu")
        self._model: torch.nn.Module = load_model(
            config.model_path, "model_path", attn_implementation=attn, trainable=True
        )
        # QAT hooks sit on the policy's expert modules; they see whatever the forward computes
        # with (the bf16 copies on one rank, FSDP2's unsharded parameters on several).
        self._qat = config.qat.build(self._model) if config.qat is not None else None
        ref_module = None
        if config.loss.kl_coef > 0:
            rcfg = config.reference
            on_cpu = rcfg.placement == "cpu"
            ref_attn = attn_implementation(dtype, cpu) if on_cpu else attn
            what = "trainer.reference.path" if rcfg.path else "model_path"
            ref_module = load_model(
                rcfg.path or config.model_path, what, attn_implementation=ref_attn, trainable=False
            )
        self._r3 = _routing_replay(self._model, ref_module, config)
        critic_module = None
        if config.critic is not None:
            critic_module = config.critic.build(config.model_path, attn_implementation=attn)
        # On CPU, the trainer's own ops (ops/): fused norms and attention blocks, shared
        # prefixes computed once; the same forward bits as HF's modules.
        for module, placement in (
            (self._model, "device"),
            (ref_module, config.reference.placement),
            (critic_module, "device"),
        ):
            on_cpu = self._device.type == "cpu" or placement == "cpu"
            if module is not None and on_cpu:
                use_fast_ops(module)
        if self._device.type == "cpu" or config.reference.placement == "cpu":
            keep_freed_memory()  # reuse activation memory instead of page-faulting it in

        def place(module: torch.nn.Module, placement: str = "device") -> PlacedModel:
            return PlacedModel(
                module,
                mesh=self._mesh,
                dtype=dtype,
                device=self._device,
                fsdp=config.fsdp,
                placement=placement,
            )

        self._policy = place(self._model)
        self._ref = place(ref_module, config.reference.placement) if ref_module else None
        self._critic = place(critic_module) if critic_module is not None else None
        embeddings = self._model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        self._vocab_size = int(embeddings.num_embeddings)
        self._optimizer = build_optimizer(list(self._model.parameters()), config, self._rank)
        # Optimizer steps applied so far: the learning-rate schedule's position (checkpointed).
        self._optimizer_steps = 0
        self._critic_optimizer: torch.optim.Optimizer | None = None
        if critic_module is not None:
            assert config.critic is not None
            self._critic_optimizer = torch.optim.AdamW(
                critic_module.parameters(),
                lr=config.critic.lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
                foreach=True,
                fused=False,
            )

    # ------------------------------------------------------------------ properties

    @property
    def model(self) -> torch.nn.Module:
        """The HF model with the fp32 master weights; ``state_dict()`` keys are HF names.

        With several ranks it is FSDP2-wrapped and the values are DTensor shards
        (``.full_tensor()`` gathers one); with one rank it is the plain module.
        """
        return self._model

    @property
    def critic(self) -> torch.nn.Module | None:
        """The critic (`miles_trainer.critic.ValueModel`), or None without one."""
        return None if self._critic is None else self._critic.module

    @property
    def rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks."""
        return self._world

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self._device

    # ------------------------------------------------------------------ forward

    def _forward(
        self,
        model: PlacedModel,
        mb: MicroBatch,
        *,
        with_entropy: bool,
        entropy_grad: bool,
        count: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        routing: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self._r3 is not None:  # R3: route as the rollout did (counting the training forward)
            routing = self._r3.record(routed_hf_order(mb.routed_BLNK), count=count)
        with routing:
            out = model(input_ids=mb.input_ids_BL, position_ids=mb.position_ids_BL, use_cache=False)
        logits_BLV = out.logits
        pos_BR, targets_BR = mb.logit_pos_BR, mb.targets_BR
        if logits_BLV.device != pos_BR.device:  # a reference kept on the CPU
            pos_BR, targets_BR = pos_BR.to(logits_BLV.device), targets_BR.to(logits_BLV.device)
        logp_BR, ent_BR = response_logprobs(
            logits_BLV,
            pos_BR,
            targets_BR,
            self.config.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        if logp_BR.device != self._device:
            logp_BR = logp_BR.to(self._device)
        return logp_BR, ent_BR

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        assert self._critic is not None
        return self._critic(
            input_ids=mb.input_ids_BL, logit_pos_BR=mb.logit_pos_BR, position_ids=mb.position_ids_BL
        )

    def _check_tokens(self, batch: TrainBatch) -> None:
        for i, toks in enumerate(batch.tokens):
            top = max(toks)
            if top >= self._vocab_size:
                raise ValueError(
                    f"{batch.name(i)}: token id {top} is out of range for the model's "
                    f"vocabulary of {self._vocab_size}"
                )

    def _check_same_batch(self, batch: TrainBatch) -> None:
        """Every rank must get the same batch; compare a cheap fingerprint across ranks."""
        if self._world == 1:
            return
        fp = [
            len(batch),
            sum(map(len, batch.tokens)),
            sum(batch.response_lengths),
            batch.num_loss_tokens(),
            sum(sum(t) for t in batch.tokens),
            # rewards and groups decide the advantages each rank computes for itself
            round(sum(batch.rewards) * 1e6) if batch.rewards is not None else -1,
            sum(batch.group_ids) if batch.group_ids is not None else -1,
        ]
        t = torch.tensor(fp + [-x for x in fp], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        hi, neg_lo = t[: len(fp)], t[len(fp) :]
        if not torch.equal(hi, -neg_lo):
            raise ValueError(
                "train_step got different batches on different ranks; every rank must pass the "
                "same TrainBatch (each rank takes its own share of it)"
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

    def _micro_batches(self, batch: TrainBatch, indices: list[int]) -> list[_Micro]:
        """This rank's micro-batches of one mini-batch; equally many on every rank.

        Rank r takes samples ``indices[r::world]``, cut by `plan_micro_batches`. Ranks with
        fewer micro-batches run zero-weight filler passes so that all ranks issue the same
        FSDP collectives.
        """
        plans = [self._plan(batch, indices[r :: self._world]) for r in range(self._world)]
        mine = plans[self._rank]
        count = max(len(p) for p in plans)
        out = []
        for j in range(count):
            chunk = mine[j] if j < len(mine) else indices[:1]
            mb = make_micro_batch(batch, chunk, self._device, packed=self.config.packing)
            out.append(_Micro(mb, j < len(mine)))
        return out

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def compute_logprobs(
        self, tokens: list[list[int]], response_lengths: list[int]
    ) -> list[list[float]]:
        """Teacher-forced response logprobs under the current policy (the rollout contract).

        ``log_softmax(float32(logits) / temperature)[token]`` for every response token. Every
        rank computes every sample (no sharing); call it on all ranks with the same input.

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
        self._policy.refresh()
        out: list[list[float]] = []
        for chunk in self._plan(batch, list(range(len(batch)))):
            mb = make_micro_batch(batch, chunk, self._device, packed=self.config.packing)
            logp_BR, _ = self._forward(self._policy, mb, with_entropy=False, entropy_grad=False)
            out.extend(mb.unpad(logp_BR))
        return out

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update: up to ``config.num_minibatches`` optimizer steps over ``batch``.

        Collective: call on every rank with the same batch. First the batch is prepared: the
        overlong penalty and the group filter (``config.advantage``) act on the rewards; then
        the batch is cut into contiguous mini-batches (``num_minibatches``, fewer only if the
        filter left fewer samples than that); within one, rank r trains on samples ``r::world`` in
        micro-batches (``micro_batch_size`` samples, or ``max_tokens_per_microbatch`` tokens;
        padded or packed) with gradient accumulation. The loss of each mini-batch is
        normalised by that mini-batch's global token/sequence counts, so any number of ranks
        and micro-batches gives the gradient of the one big mini-batch.

        No-grad passes before any update give the old logprobs (unless
        ``loss.use_rollout_logprobs``; with one mini-batch the training forward's own,
        detached, are the same numbers and no pass runs), the reference logprobs (KL) and the
        critic's values (GAE). Advantages come from the configured estimator (or the batch's
        precomputed ones).

        Args:
            batch: the samples to train on.

        Returns:
            Metrics, identical on every rank (see the README for the list): the loss terms
            averaged over the mini-batches, ``grad_norm``, ``lr``, ``tokens``,
            ``skipped_steps``, the train/rollout logprob gap, and the batch statistics.

        Raises:
            ValueError: fewer samples than ``num_minibatches``, token ids outside the
                vocabulary, different batches on different ranks, or an estimator that cannot
                run on this batch.
            NonFiniteError: a non-finite loss or gradient with ``on_nonfinite = "stop"`` (the
                weights are untouched).
        """
        cfg, lcfg = self.config, self.config.loss
        if len(batch) < cfg.num_minibatches:
            raise ValueError(
                f"batch has {len(batch)} samples but num_minibatches = {cfg.num_minibatches}; "
                "every optimizer step needs at least one sample"
            )
        self._check_tokens(batch)
        if self._r3 is not None:
            self._r3.check(batch)
        self._check_same_batch(batch)
        prepared, out = shape_and_filter(batch, cfg.advantage)
        if prepared is None:  # the group filter dropped everything: no update this step
            out.update(samples=0.0, tokens=0.0, skipped_steps=0.0, optimizer_steps=0.0)
            return out
        batch = prepared
        out.update(_version_metrics(batch))
        n_mb = min(cfg.num_minibatches, len(batch))
        minibatches = _minibatch_indices(len(batch), n_mb)
        micros = [self._micro_batches(batch, idx) for idx in minibatches]
        for placed in (self._policy, self._critic):
            if placed is not None:
                placed.refresh()

        # Before any update: old and reference logprobs, the critic's values. With one
        # mini-batch the training forward itself runs before the update, so it supplies the
        # old logprobs.
        need_old = not lcfg.use_rollout_logprobs
        old_from_train = need_old and n_mb == 1
        old_pass = need_old and not old_from_train
        old: list[list[torch.Tensor]] = [[] for _ in micros]
        ref: list[list[torch.Tensor]] = [[] for _ in micros]
        old_values: list[list[torch.Tensor]] = [[] for _ in micros]
        if old_pass or self._ref is not None or self._critic is not None:
            with torch.no_grad():
                for k, group in enumerate(micros):
                    for m in group:
                        if old_pass:
                            logp, _ = self._forward(
                                self._policy, m.mb, with_entropy=False, entropy_grad=False
                            )
                            old[k].append(logp)
                        if self._ref is not None:
                            logp, _ = self._forward(
                                self._ref, m.mb, with_entropy=False, entropy_grad=False
                            )
                            ref[k].append(logp)
                        if self._critic is not None:
                            old_values[k].append(self._values(m.mb))

        returns = self._fill_advantages(batch, micros, old_values, out)

        metrics = StepMetrics(n_mb)
        grad_norms: list[float] = []
        critic_norms: list[float] = []
        skipped = 0
        for k, (idx, group) in enumerate(zip(minibatches, micros)):
            n_tok = max(1, batch.num_loss_tokens(idx))
            counts = {
                "num_global_tokens": n_tok,
                "num_global_seqs": len(idx),
                "norm_length": lcfg.norm_length or max(batch.response_lengths[i] for i in idx),
            }
            self._zero_grad()
            for j, m in enumerate(group):
                mb = m.mb
                logp_BR, ent_BR = self._forward(
                    self._policy,
                    mb,
                    with_entropy=True,
                    entropy_grad=lcfg.entropy_coef > 0,
                    count=m.real,
                )
                if old_from_train:
                    old_BR = logp_BR.detach()
                else:
                    old_BR = old[k][j] if need_old else mb.rollout_logp_BR
                loss, terms = self._loss_fn(
                    logp_BR,
                    old_BR,
                    mb.advantages_BR,
                    mb.mask_BR,
                    ref_logp_BT=ref[k][j] if self._ref is not None else None,
                    entropy_BT=ent_BR,
                    rollout_logp_BT=mb.rollout_logp_BR,
                    **counts,
                )
                total = loss
                if self._critic is not None:
                    assert cfg.critic is not None
                    assert returns is not None
                    v_loss, v_terms = value_loss(
                        self._values(mb),
                        old_values[k][j],
                        mb.per_token(returns),
                        mb.mask_BR,
                        value_clip=cfg.critic.value_clip,
                        loss_agg=lcfg.loss_agg,
                        **counts,
                    )
                    total = loss + v_loss
                    terms.update(v_terms)
                # FSDP2 averages gradients over ranks; scaling by world turns that into the
                # sum of per-rank partial sums, i.e. the global-batch gradient.
                (total * (self._world if m.real else 0.0)).backward()
                for placed in (self._policy, self._critic):
                    if placed is not None:
                        placed.accumulate_grads()
                train_BR = old_BR if need_old else logp_BR.detach()
                diff_BR = train_BR - mb.rollout_logp_BR
                terms["loss"] = loss.detach()
                terms["train_rollout_logprob_abs_diff"] = _token_mean(diff_BR.abs(), mb, n_tok)
                terms["train_rollout_logprob_diff"] = _token_mean(diff_BR, mb, n_tok)
                metrics.add(k, terms, real=m.real)
            grad_norm, critic_norm = self._clip_grad_norms()
            grad_norms.append(grad_norm)
            critic_norms.append(critic_norm)
            if self._finite(metrics, k, grad_norm, critic_norm):
                set_lr(self._optimizer, cfg.lr_at(self._optimizer_steps))
                self._optimizer.step()
                self._optimizer_steps += 1
                if self._critic_optimizer is not None:
                    self._critic_optimizer.step()
                if k + 1 < len(micros):
                    for placed in (self._policy, self._critic):
                        if placed is not None:
                            placed.refresh()
            elif cfg.on_nonfinite == "stop":
                self._zero_grad()
                raise NonFiniteError(
                    f"train_step: non-finite loss or gradient in mini-batch {k} (grad_norm "
                    f"{grad_norm}); the step was not applied, the weights are untouched "
                    '(trainer.on_nonfinite: "skip" skips such steps instead)'
                )
            else:
                skipped += 1
            self._zero_grad()

        out.update(metrics.reduce(self._device, self._world))
        if self._r3 is not None:
            out.update(self._r3.metrics(self._device))
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if self._critic is not None:
            out["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
        out["lr"] = cfg.lr_at(max(self._optimizer_steps - 1, 0))
        out["samples"] = float(len(batch))
        out["tokens"] = float(batch.num_loss_tokens())
        out["optimizer_steps"] = float(n_mb - skipped)
        out["skipped_steps"] = float(skipped)
        return out

    def _fill_advantages(
        self,
        batch: TrainBatch,
        micros: list[list[_Micro]],
        old_values: list[list[torch.Tensor]],
        out: dict[str, float],
    ) -> list[list[float]] | None:
        """Run the estimator and write each micro-batch's ``advantages_BR``; return GAE's
        returns (None without a critic). Adds the advantage statistics to ``out``."""
        values = None
        if self._critic is not None:
            # Each rank scored its own samples; GAE and whitening need them all.
            mine: dict[int, list[float]] = {}
            for group, vals in zip(micros, old_values):
                for m, v_BR in zip(group, vals):
                    if m.real:
                        mine.update(zip(m.mb.indices, m.mb.unpad(v_BR)))
            parts: list[Any] = [mine]
            if self._world > 1:
                parts = [None] * self._world
                dist.all_gather_object(parts, mine)
            merged = {i: v for part in parts for i, v in part.items()}
            values = [merged[i] for i in range(len(batch))]
        adv, returns = batch_advantages(batch, self.config.advantage, values)
        xs = [a for row, mask in zip(adv, batch.loss_masks) for a, m in zip(row, mask) if m]
        if xs:
            out["advantage_mean"] = sum(xs) / len(xs)
            out["advantage_abs_mean"] = sum(map(abs, xs)) / len(xs)
        for group in micros:
            for m in group:
                m.mb.advantages_BR = m.mb.per_token(adv)
        return returns

    def _zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
        if self._critic_optimizer is not None:
            self._critic_optimizer.zero_grad(set_to_none=True)

    def _finite(self, metrics: StepMetrics, k: int, grad_norm: float, critic_norm: float) -> bool:
        """Whether mini-batch ``k``'s loss and gradient norms are finite on every rank."""
        ok = math.isfinite(grad_norm) and math.isfinite(critic_norm)
        local = metrics.local_sum("loss", k) + metrics.local_sum("value_loss", k)
        if self._world > 1:
            flag = torch.tensor([0.0 if math.isfinite(local) else 1.0], device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return ok and flag.item() == 0.0
        return ok and math.isfinite(local)

    def _clip_grad_norms(self) -> tuple[float, float]:
        cfg = self.config
        norm = _clip(self._model, cfg.grad_clip)
        critic = 0.0
        if self._critic is not None:
            assert cfg.critic is not None
            critic = _clip(self._critic.module, cfg.critic.grad_clip)
        return norm, critic

    def save_hf_checkpoint(self, path: str | os.PathLike[str], *, dtype: str | None = None) -> None:
        """Gather the full weights and write an HF model directory from rank 0. Collective.

        The directory holds config.json, model.safetensors (or shards plus an index),
        generation_config.json and the tokenizer files of ``config.model_path`` when present.
        It appears atomically: written to a temp dir next to ``path`` and renamed into place;
        an existing ``path`` is replaced; on error nothing is left half-written.

        Args:
            path: the directory to write (a shared filesystem when ranks span nodes).
            dtype: weight dtype to write ("float32", "bfloat16", "float16"); default
                ``config.dtype``.

        Raises:
            ValueError: an unknown dtype.
            RuntimeError: on ranks other than 0 when rank 0 failed to write.
        """
        name = dtype or self.config.dtype
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {name!r}")
        state = gather_full_state_dict(self._model)
        error: BaseException | None = None
        if self._rank == 0:
            try:
                write_hf_dir(
                    path,
                    state,
                    config=self._model.config,
                    generation_config=getattr(self._model, "generation_config", None),
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

    def _parts(self) -> train_state.Parts:
        parts: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {
            "model": (self._model, self._optimizer)
        }
        if self._critic is not None:
            assert self._critic_optimizer is not None
            parts["critic"] = (self._critic.module, self._critic_optimizer)
        return parts

    def save_checkpoint(
        self, path: str | os.PathLike[str], *, step: int, client_state: Any = None
    ) -> None:
        """Write the whole training state to the directory ``path``, atomically. Collective.

        Saved: the policy's fp32 weights and its optimizer state (torch AdamW format whatever
        ``config.offload`` holds it in), the critic and its optimizer, every rank's RNG states,
        ``step`` and ``client_state`` (rank 0's; pickled). The frozen reference is not saved
        (it is reloaded from its path). See `miles_trainer.checkpoint` for the layout.

        Args:
            path: the checkpoint directory (a filesystem every rank sees); replaced if it
                exists.
            step: the caller's step number, returned by `load_checkpoint`.
            client_state: anything picklable the caller wants back at resume (the loop's data
                position, ...), or None.

        Raises:
            RuntimeError: some rank failed (nothing is left at ``path``; an older checkpoint
                there is kept).
        """
        parts = self._parts()
        write_checkpoint(
            path,
            device=self._device,
            backend="fsdp",
            step=step,
            hf_config=self._model.config,
            source_dir=self.config.model_path,
            layout=self._layout(),
            extra_meta={
                "dtype": self.config.dtype,
                "optimizer_steps": self._optimizer_steps,
                **train_state.state_meta(parts),
            },
            client_state=client_state,
            write_state=lambda tmp: train_state.save_state(tmp / train_state.SUBDIR, parts),
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Restore what `save_checkpoint` wrote into this trainer. Collective.

        The trainer must be built from the same model with the same world size (and critic
        or not); the optimizer state loads whatever ``config.offload`` is. The RNG states are
        restored last, so this process continues from where the saving one was.

        Returns:
            The step and client state that were saved.

        Raises:
            CheckpointError: a torn checkpoint, one of another backend, model or layout (the
                message names the difference); nothing is changed then.
        """
        meta = read_meta(path)
        check_compatible(
            meta, path, backend="fsdp", hf_config=self._model.config, layout=self._layout()
        )
        parts = self._parts()
        if meta["parts"] != sorted(parts):
            raise CheckpointError(
                f"checkpoint {path} holds {meta['parts']}, this trainer has {sorted(parts)}: "
                "build the trainer with the same critic setting"
            )
        train_state.load_state(Path(path) / train_state.SUBDIR, parts, meta)
        self._optimizer_steps = int(meta.get("optimizer_steps", 0))
        for placed in (self._policy, self._critic):
            if placed is not None:
                placed.refresh()
        return load_common(path, meta)

    def _layout(self) -> dict[str, Any]:
        return {"world_size": self._world}

    def state_dict(self) -> dict[str, Any]:
        """Sharded model and optimizer state for resuming (DTensor values). Collective.

        Save it with ``torch.distributed.checkpoint.save``; load it back into a trainer built
        with the same config and world size via `load_state_dict`.
        """
        model_sd, optim_sd = get_state_dict(self._model, self._optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "optimizer_steps": self._optimizer_steps}
        if self._critic is not None:
            assert self._critic_optimizer is not None
            critic_sd, critic_optim_sd = get_state_dict(self._critic.module, self._critic_optimizer)
            state.update(critic=critic_sd, critic_optimizer=critic_optim_sd)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned. Collective.

        Values are copied: the trainer shares no tensor with ``state`` afterwards (the optimizer
        would otherwise adopt the given moment tensors and update them in place).
        """
        set_state_dict(
            self._model,
            self._optimizer,
            model_state_dict=state["model"],
            optim_state_dict=_clone_tensors(state["optimizer"]),
        )
        self._optimizer_steps = int(state.get("optimizer_steps", 0))
        if self._critic is not None:
            assert self._critic_optimizer is not None
            set_state_dict(
                self._critic.module,
                self._critic_optimizer,
                model_state_dict=state["critic"],
                optim_state_dict=_clone_tensors(state["critic_optimizer"]),
            )


def _routing_replay(
    model: torch.nn.Module, ref: torch.nn.Module | None, config: TrainerConfig
) -> RoutingReplay | None:
    """R3 on the policy's (and the reference's) MoE routers; None for a dense model.

    Installed on every MoE model it supports, so that a batch with routed experts reports the
    router agreement even with replay off (``config.r3`` False: routing unchanged).

    Raises:
        ValueError: ``config.r3`` on a model without replayable routers.
    """
    dims = hf_moe_dims(model.config)
    replay = None
    if dims is not None:
        num_layers, top_k, num_experts = dims
        replay = RoutingReplay(
            replay=config.r3, num_layers=num_layers, top_k=top_k, num_experts=num_experts
        )
        if install_hf(model, replay) == 0:
            replay = None
        elif ref is not None:
            install_hf(ref, replay)
    if config.r3 and replay is None:
        raise ValueError(
            f"trainer.r3 needs an MoE model whose routers the FSDP backend replays (Hugging "
            f"Face Qwen3-MoE); {config.model_path} is "
            f"{getattr(model.config, 'model_type', '?')!r}: set trainer.r3: false"
        )
    return replay


def _clip(module: torch.nn.Module, max_norm: float | None) -> float:
    """Clip the gradients' global 2-norm (None: only measure it); return the norm before."""
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm.item())


def _clone_tensors(tree: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every tensor cloned."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone_tensors(v) for v in tree)
    return tree
