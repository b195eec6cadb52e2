"""`FSDPTrainer`: an HF causal LM sharded with FSDP2, trained with the clipped RL loss.

Every rank calls every method with the same arguments (they are collective). Run one process
for a single device, or ``torchrun --nproc_per_node N`` for N (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from miles_trainer._attention import attn_implementation
from miles_trainer._distributed import broadcast_ok, init_distributed
from miles_trainer._hf_dir import write_hf_dir
from miles_trainer._malloc import keep_freed_memory
from miles_trainer._rmsnorm import use_fast_rms_norm
from miles_trainer.batch import MicroBatch, TrainBatch, pack_micro_batch
from miles_trainer.config import TrainerConfig
from miles_trainer.fsdp.checkpoint import gather_full_state_dict
from miles_trainer.fsdp.optim import build_optimizer
from miles_trainer.fsdp.parallelize import MixedPrecisionCopy, cast_frozen_params, load_model
from miles_trainer.logprobs import response_logprobs
from miles_trainer.losses import policy_loss

__all__ = ["FSDPTrainer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per-micro-batch metrics summed over micro-batches and ranks (each is a global partial sum).
_SUMMED = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "abs_diff_sum")


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
    """Policy trainer: HF causal LM + FSDP2 + AdamW + the clipped RL loss.

    Construction initialises ``torch.distributed`` when needed (env:// under a launcher, else a
    one-process group) and loads ``config.model_path`` in float32 on every rank. With several
    ranks, each decoder layer and the root are sharded with FSDP2 ``fully_shard`` over a 1-D
    ``("dp",)`` mesh. With one rank the model stays a plain module (FSDP2 would shard nothing
    and only add overhead) and low-precision compute casts copies of the fp32 parameters the
    way FSDP2's mixed precision does (see ``_parallelize.py``). With
    ``config.loss.kl_coef > 0`` a frozen reference model is loaded and laid out the same way.

    Args:
        config: the trainer configuration.

    Raises:
        FileNotFoundError: a model directory is missing, or holds no config/safetensors weights.
    """

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self._rank, self._world, self._device = init_distributed()
        self._mesh = init_device_mesh(self._device.type, (self._world,), mesh_dim_names=("dp",))
        torch.manual_seed(config.seed)
        dtype = _DTYPES[config.dtype]
        attn = attn_implementation(dtype, self._device)
        self._sharded = self._world > 1
        self._model: torch.nn.Module = load_model(
            config.model_path, "model_path", attn_implementation=attn, trainable=True
        )
        # QAT hooks sit on the policy's expert modules; they see whatever the forward computes
        # with (the bf16 copies on one rank, FSDP2's unsharded parameters on several).
        self._qat = config.qat.build(self._model) if config.qat is not None else None
        self._ref: torch.nn.Module | None = None
        if config.loss.kl_coef > 0:
            ref_path = config.ref_model_path or config.model_path
            what = "ref_model_path" if config.ref_model_path else "model_path"
            self._ref = load_model(ref_path, what, attn_implementation=attn, trainable=False)
        if dtype != torch.float32 and self._device.type == "cpu":
            # Low precision on CPU: GEMMs are cheap, elementwise passes are not (_rmsnorm.py).
            use_fast_rms_norm(self._model)
            if self._ref is not None:
                use_fast_rms_norm(self._ref)
        if self._device.type == "cpu":
            keep_freed_memory()  # reuse activation memory instead of page-faulting it in
        self._mp: MixedPrecisionCopy | None = None
        if self._sharded:
            config.fsdp.build(self._model, self._mesh, dtype)
            if self._ref is not None:
                config.fsdp.build(self._ref, self._mesh, dtype)
        else:
            self._model.to(self._device)
            if self._ref is not None:
                self._ref.to(self._device)
            if dtype != torch.float32:
                self._mp = MixedPrecisionCopy(self._model, dtype)
                if self._ref is not None:
                    cast_frozen_params(self._ref, dtype)
        embeddings = self._model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        self._vocab_size = int(embeddings.num_embeddings)
        self._optimizer = build_optimizer(list(self._model.parameters()), config, self._rank)

    # ------------------------------------------------------------------ properties

    @property
    def model(self) -> torch.nn.Module:
        """The HF model with the fp32 master weights; ``state_dict()`` keys are HF names.

        With several ranks it is FSDP2-wrapped and the values are DTensor shards
        (``.full_tensor()`` gathers one); with one rank it is the plain module.
        """
        return self._model

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
        self, model: torch.nn.Module, mb: MicroBatch, *, with_entropy: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if model is self._model and self._mp is not None:
            out = self._mp.forward(input_ids=mb.input_ids_BL, use_cache=False)
        else:
            out = model(input_ids=mb.input_ids_BL, use_cache=False)
        logits_BLV = out.logits
        return response_logprobs(
            logits_BLV,
            mb.logit_pos_BR,
            mb.targets_BR,
            self.config.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    def _check_tokens(self, batch: TrainBatch) -> None:
        for i, toks in enumerate(batch.tokens):
            top = max(toks)
            if top >= self._vocab_size:
                raise ValueError(
                    f"sample {i}: token id {top} is out of range for the model's vocabulary "
                    f"of {self._vocab_size}"
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
        ]
        t = torch.tensor(fp + [-x for x in fp], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        hi, neg_lo = t[: len(fp)], t[len(fp) :]
        if not torch.equal(hi, -neg_lo):
            raise ValueError(
                "train_step got different batches on different ranks; every rank must pass the "
                "same TrainBatch (each rank takes its own share of it)"
            )

    def _micro_batches(self, batch: TrainBatch, indices: list[int]) -> list[_Micro]:
        """This rank's micro-batches of one mini-batch; equally many on every rank.

        Rank r takes samples ``indices[r::world]``. Ranks whose share is short run zero-weight
        filler passes so that all ranks issue the same FSDP collectives.
        """
        mbs = self.config.micro_batch_size
        share = indices[self._rank :: self._world]
        longest = math.ceil(len(indices) / self._world)
        out = []
        for j in range(math.ceil(longest / mbs)):
            chunk = share[j * mbs : (j + 1) * mbs]
            real = bool(chunk)
            out.append(_Micro(pack_micro_batch(batch, chunk or indices[:1], self._device), real))
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
        zeros = [[0] * r for r in response_lengths]
        batch = TrainBatch(
            tokens=tokens,
            response_lengths=response_lengths,
            loss_masks=zeros,
            rollout_logprobs=[[0.0] * r for r in response_lengths],
            advantages=[[0.0] * r for r in response_lengths],
        )
        self._check_tokens(batch)
        if self._mp is not None:
            self._mp.refresh()
        out: list[list[float]] = []
        mbs = self.config.micro_batch_size
        for start in range(0, len(batch), mbs):
            indices = list(range(start, min(start + mbs, len(batch))))
            mb = pack_micro_batch(batch, indices, self._device)
            logp_BR, _ = self._forward(self._model, mb, with_entropy=False, entropy_grad=False)
            out.extend(mb.unpad(logp_BR))
        return out

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update: ``config.num_minibatches`` optimizer steps over ``batch``.

        Collective: call on every rank with the same batch. The batch is cut into contiguous
        mini-batches; within one, rank r trains on samples ``r::world`` in micro-batches of
        ``config.micro_batch_size`` with gradient accumulation. The loss of each mini-batch is
        normalised by that mini-batch's global token/sequence counts, so any number of ranks
        and micro-batches gives the gradient of the one big mini-batch.

        Unless ``config.loss.use_rollout_logprobs``, the old logprobs are the current policy's
        before the first update: with ``config.num_minibatches == 1`` they are the training
        forward's own logprobs, detached (every forward precedes the only optimizer step, so
        they are the same numbers); otherwise a no-grad forward pass over the whole batch
        computes them first.

        Args:
            batch: the samples to train on (needs at least ``num_minibatches`` of them).

        Returns:
            Metrics, identical on every rank, averaged over the mini-batches: ``loss``,
            ``pg_loss``, ``kl``, ``entropy``, ``clip_frac``, ``ratio_mean``, ``grad_norm``
            (before clipping), ``lr``, ``train_rollout_logprob_abs_diff`` (mean over loss
            tokens of ``|train logp - rollout logp|``, see the README), ``tokens`` (loss tokens
            in the batch) and ``skipped_steps`` (optimizer steps skipped for a non-finite
            gradient norm).

        Raises:
            ValueError: too few samples, token ids outside the vocabulary, or different batches
                on different ranks.
        """
        cfg, lcfg = self.config, self.config.loss
        if len(batch) < cfg.num_minibatches:
            raise ValueError(
                f"batch has {len(batch)} samples but num_minibatches = {cfg.num_minibatches}; "
                "every optimizer step needs at least one sample"
            )
        self._check_tokens(batch)
        self._check_same_batch(batch)
        minibatches = _minibatch_indices(len(batch), cfg.num_minibatches)
        micros = [self._micro_batches(batch, idx) for idx in minibatches]
        if self._mp is not None:
            self._mp.refresh()

        # Old (behaviour) and reference logprobs, before any update. With one mini-batch the
        # training forward itself runs before the update, so it supplies the old logprobs.
        need_old = not lcfg.use_rollout_logprobs
        old_from_train = need_old and cfg.num_minibatches == 1
        old_pass = need_old and not old_from_train
        old: list[list[torch.Tensor]] = [[] for _ in micros]
        ref: list[list[torch.Tensor]] = [[] for _ in micros]
        if old_pass or self._ref is not None:
            with torch.no_grad():
                for k, group in enumerate(micros):
                    for m in group:
                        if old_pass:
                            logp, _ = self._forward(
                                self._model, m.mb, with_entropy=False, entropy_grad=False
                            )
                            old[k].append(logp)
                        if self._ref is not None:
                            logp, _ = self._forward(
                                self._ref, m.mb, with_entropy=False, entropy_grad=False
                            )
                            ref[k].append(logp)

        sums_KM = torch.zeros(len(micros), len(_SUMMED), dtype=torch.float64, device=self._device)
        grad_norms: list[float] = []
        skipped = 0
        for k, (idx, group) in enumerate(zip(minibatches, micros)):
            n_tok = max(1, batch.num_loss_tokens(idx))
            self._optimizer.zero_grad(set_to_none=True)
            for j, m in enumerate(group):
                mb = m.mb
                logp_BR, ent_BR = self._forward(
                    self._model, mb, with_entropy=True, entropy_grad=lcfg.entropy_coef > 0
                )
                if old_from_train:
                    old_BR = logp_BR.detach()
                else:
                    old_BR = old[k][j] if need_old else mb.rollout_logp_BR
                loss, metrics = policy_loss(
                    logp_BR,
                    old_BR,
                    mb.advantages_BR,
                    mb.mask_BR,
                    lcfg,
                    ref_logp_BT=ref[k][j] if self._ref is not None else None,
                    entropy_BT=ent_BR,
                    rollout_logp_BT=mb.rollout_logp_BR,
                    num_global_tokens=n_tok,
                    num_global_seqs=len(idx),
                )
                # FSDP2 averages gradients over ranks; scaling by world turns that into the
                # sum of per-rank partial sums, i.e. the global-batch gradient.
                (loss * (self._world if m.real else 0.0)).backward()
                if self._mp is not None:
                    self._mp.accumulate_grads()
                if not m.real:
                    continue
                train_BR = old_BR if need_old else logp_BR.detach()
                diff_BR = (train_BR - mb.rollout_logp_BR).abs()
                abs_diff = torch.where(mb.mask_BR, diff_BR, torch.zeros_like(diff_BR)).sum()
                values = [loss.detach()] + [metrics[n] for n in _SUMMED[1:-1]] + [abs_diff]
                sums_KM[k] += torch.stack([v.to(torch.float64) for v in values])
            grad_norm = self._clip_grad_norm()
            grad_norms.append(grad_norm)
            if math.isfinite(grad_norm):
                self._optimizer.step()
                if self._mp is not None and k + 1 < len(micros):
                    self._mp.refresh()
            else:
                skipped += 1
            self._optimizer.zero_grad(set_to_none=True)

        if self._world > 1:
            dist.all_reduce(sums_KM)
        mean_M = sums_KM.mean(dim=0).tolist()
        out = {name: float(v) for name, v in zip(_SUMMED[:-1], mean_M[:-1])}
        total_tokens = batch.num_loss_tokens()
        out["train_rollout_logprob_abs_diff"] = float(sums_KM[:, -1].sum().item()) / max(
            1, total_tokens
        )
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = float(self._optimizer.param_groups[0]["lr"])
        out["tokens"] = float(total_tokens)
        out["skipped_steps"] = float(skipped)
        return out

    def _clip_grad_norm(self) -> float:
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        params = [p for p in self._model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm.item())

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

    def state_dict(self) -> dict[str, Any]:
        """Sharded model and optimizer state for resuming (DTensor values). Collective.

        Save it with ``torch.distributed.checkpoint.save``; load it back into a trainer built
        with the same config and world size via `load_state_dict`.
        """
        model_sd, optim_sd = get_state_dict(self._model, self._optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

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


def _clone_tensors(tree: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every tensor cloned."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone_tensors(v) for v in tree)
    return tree
