"""The embedded CPU inference engine: continuous batching with exact logprobs.

    engine = EngineConfig(model_path="/path/to/hf_dir").build()
    out = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=16))
    engine.shutdown()

One background thread per data-parallel rank owns that rank's batch, KV cache and prefix cache
(see ``_scheduler.py``); the ranks share the model's weights. ``submit`` may be called from any
thread and many concurrent requests are decoded together. The engine is a
``miles_transfer.WeightReceiver``.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import random
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from miles_rollout._model import CausalLMRunner
from miles_rollout._prefix_cache import RadixCache
from miles_rollout._scheduler import PauseMode, Request, Scheduler
from miles_rollout._weights import (
    check_checkpoint_dir,
    load_safetensors_dir,
    param_table,
    prepare_update,
)
from miles_rollout.config import EngineConfig
from miles_rollout.outputs import GenerateOutput
from miles_rollout.quantized import QuantizedWeights, quantized_digest, select_weights
from miles_rollout.sampling_params import SamplingParams
from miles_rollout.version import __version__
from miles_transfer import tensor_digest

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

_PAUSE_MODES = ("abort", "retract", "in_place")
# Default prefix-cache budget (keys and values of every layer); see EngineConfig.
_PREFIX_CACHE_DEFAULT_BYTES = 512 << 20
# Session keys remembered for rank affinity (least recently used forgotten first).
_MAX_SESSIONS = 1 << 16
T = TypeVar("T")


@dataclass(eq=False, slots=True)
class _Rank:
    """One data-parallel rank: its own runner (KV cache), scheduler thread and prefix cache."""

    index: int
    runner: CausalLMRunner
    scheduler: Scheduler
    cache: RadixCache | None
    in_flight: int = 0  # submitted and not finished (the engine's load measure)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Engine:
    """An in-process inference engine for a local HF checkpoint (Qwen3 / Qwen2 / Llama).

    Args:
        config: what to load and how to serve it.

    Raises:
        ValueError: the directory is missing or is not a checkpoint, the architecture is not
            supported, or ``config.context_length`` exceeds the model's.
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        path = check_checkpoint_dir(config.model_path)
        self.dtype: torch.dtype = config.torch_dtype
        self.model_path = str(path.resolve())
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.eval().requires_grad_(False)
        self.model = model
        max_pos = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        ctx = config.context_length if config.context_length is not None else max_pos
        if ctx < 2:
            raise ValueError(
                f"the model config has max_position_embeddings={max_pos}; set "
                "EngineConfig.context_length"
            )
        if max_pos and ctx > max_pos:
            raise ValueError(
                f"context_length {ctx} exceeds the model's max_position_embeddings {max_pos}"
            )
        self.context_length = ctx
        self.tokenizer: Any = None
        self.tokenizer_path: str | None = None
        if any((path / f).is_file() for f in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self.tokenizer_path = self.model_path
        self.eos_token_ids = _eos_ids(model, self.tokenizer)
        self._params = param_table(model)
        # Low-precision serving (EngineConfig.weight_format): quantized at every update.
        self._quant = _build_quantized(model, config)
        # The names a full checksum reports: the module's own (fused experts stay fused).
        self._param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        self._weight_version = config.weight_version
        self._rng = random.Random(config.seed)
        threads = config.num_threads
        if threads is None and config.dp_size > 1:  # ranks share the cores
            threads = max(1, torch.get_num_threads() // config.dp_size)
        self._ranks = [self._make_rank(i, model, ctx, threads) for i in range(config.dp_size)]
        self.vocab_size = self._ranks[0].runner.vocab_size
        # Rank 0's parts under their single-rank names (tests and tools read them).
        self._runner = self._ranks[0].runner
        self._scheduler = self._ranks[0].scheduler
        self._prefix_cache = self._ranks[0].cache
        self._load_lock = threading.Lock()  # in_flight counters and session affinity
        self._control_lock = threading.Lock()  # one all-ranks barrier at a time
        self._session_ranks: OrderedDict[str, int] = OrderedDict()

    def _make_rank(self, index: int, model: Any, ctx: int, threads: int | None) -> _Rank:
        config = self.config
        runner = CausalLMRunner(
            model,
            max_batch=config.max_running_requests,
            context_length=ctx,
            kernel_backend=config.kernel_backend,
            **({"served": self._quant.served} if self._quant is not None else {}),
        )
        cache: RadixCache | None = None
        if config.enable_prefix_cache:
            capacity = config.prefix_cache_tokens
            if capacity is None:
                capacity = max(_PREFIX_CACHE_DEFAULT_BYTES // runner.pool_bytes(1), 2 * ctx)
            cache = RadixCache(capacity, session_ttl_s=config.session_ttl_s)
        scheduler = Scheduler(
            runner,
            max_running=config.max_running_requests,
            tokenizer=self.tokenizer,
            weight_version=lambda: self._weight_version,
            num_threads=threads,
            prefix_cache=cache,
            reserve_sessions=config.session_reservation,
            name=f"miles-engine-dp{index}" if config.dp_size > 1 else "miles-engine",
        )
        return _Rank(index=index, runner=runner, scheduler=scheduler, cache=cache)

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks."""
        return len(self._ranks)

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers (R3 capture available)."""
        return self._ranks[0].runner.is_moe

    # ---- generation --------------------------------------------------------------------------

    def submit(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        data_parallel_rank: int | None = None,
        routing_key: str | None = None,
        return_routed_experts: bool = False,
    ) -> Future[GenerateOutput]:
        """Queue one request; return a future for its output. Thread-safe.

        Cancelling the future drops the request from the batch.

        Args:
            input_ids: the prompt tokens.
            sampling_params: how to sample (defaults: ``SamplingParams()``).
            return_logprob: report each output token's logprob.
            rid: the request id (a random one if absent).
            data_parallel_rank: the rank to run on (what sglang-router sends with
                ``--dp-aware``). ``None``: the rank this ``routing_key`` used last, else the
                least loaded one.
            routing_key: the session key (``X-SMG-Routing-Key``): keeps a session's turns
                on one rank, where its prefix is cached.
            return_routed_experts: MoE models: report each token's top-k expert ids per
                layer (``GenerateOutput.routed_experts``, R3).

        Raises:
            ValueError: an empty prompt, token ids outside the vocabulary, a prompt that does
                not fit the context length, stop strings without a tokenizer, a
                ``data_parallel_rank`` that does not exist, or ``return_routed_experts`` on a
                dense model.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__} "
                "(use SamplingParams.from_dict for a dict)"
            )
        prompt = self._check_prompt(input_ids)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings {params.stop} need a tokenizer, and {self.model_path} has none; "
                "use stop_token_ids"
            )
        room = self.context_length - len(prompt)
        max_new = room if params.max_new_tokens is None else min(params.max_new_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        if routing_key is not None and not isinstance(routing_key, str):
            raise ValueError(f"routing_key must be a string, got {routing_key!r}")
        if return_routed_experts and not self.is_moe:
            raise ValueError(
                "return_routed_experts needs a mixture-of-experts model, and "
                f"{self.model_path} is a dense {self.model.config.model_type} model (no "
                "experts to report); drop return_routed_experts"
            )
        rank = self._pick_rank(data_parallel_rank, routing_key)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        fut: Future[GenerateOutput] = Future()
        req = Request(
            rid=rid if rid is not None else uuid.uuid4().hex,
            prompt=prompt,
            params=params,
            return_logprob=return_logprob,
            max_new_tokens=max_new,
            stop_ids=frozenset(stop_ids),
            seed=seed,
            future=fut,
            session=routing_key,
            return_routed_experts=return_routed_experts,
        )
        with self._load_lock:
            rank.in_flight += 1
        try:
            rank.scheduler.add(req)
        except BaseException:
            self._request_done(rank)
            raise
        fut.add_done_callback(lambda _: self._request_done(rank))
        return fut

    def _request_done(self, rank: _Rank) -> None:
        with self._load_lock:
            rank.in_flight -= 1

    def _pick_rank(self, data_parallel_rank: int | None, routing_key: str | None) -> _Rank:
        n = len(self._ranks)
        with self._load_lock:
            if data_parallel_rank is not None:
                r = data_parallel_rank
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
                    raise ValueError(
                        f"data_parallel_rank {r!r} does not exist: this engine has dp_size {n} "
                        f"(ranks 0..{n - 1}); omit it to let the engine choose"
                    )
                rank = self._ranks[r]
            elif routing_key is not None and routing_key in self._session_ranks:
                rank = self._ranks[self._session_ranks[routing_key]]
            else:
                rank = min(self._ranks, key=lambda x: (x.in_flight, x.index))
            if routing_key is not None:
                self._session_ranks[routing_key] = rank.index
                self._session_ranks.move_to_end(routing_key)
                if len(self._session_ranks) > _MAX_SESSIONS:
                    self._session_ranks.popitem(last=False)
        return rank

    def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        data_parallel_rank: int | None = None,
        routing_key: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput:
        """Generate and wait (blocking); see :meth:`submit`."""
        return self.submit(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            rid=rid,
            data_parallel_rank=data_parallel_rank,
            routing_key=routing_key,
            return_routed_experts=return_routed_experts,
        ).result()

    async def async_generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        data_parallel_rank: int | None = None,
        routing_key: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput:
        """Generate without blocking the event loop; see :meth:`submit`."""
        fut = self.submit(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            rid=rid,
            data_parallel_rank=data_parallel_rank,
            routing_key=routing_key,
            return_routed_experts=return_routed_experts,
        )
        return await asyncio.wrap_future(fut)

    def _check_prompt(self, input_ids: Sequence[int]) -> list[int]:
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        raw = list(input_ids)
        if not raw:
            raise ValueError("input_ids is empty; a prompt needs at least one token")
        bad = [t for t in raw if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"input_ids must be integers, got {bad[:5]}")
        prompt = [int(t) for t in raw]
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(
                f"input_ids must be in [0, {self.vocab_size}) (the model's vocabulary), "
                f"got values in [{lo}, {hi}]"
            )
        if len(prompt) >= self.context_length:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) does not fit the context length "
                f"({self.context_length} tokens): at most {self.context_length - 1} prompt "
                "tokens leave room for one new token"
            )
        return prompt

    # ---- control -----------------------------------------------------------------------------

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop generating (SGLang's pause modes); new requests wait until continue.

        Args:
            mode: ``"abort"``: running and waiting requests finish now with finish reason
                ``abort`` and their partial output. ``"retract"``: running requests leave
                the batch (their KV cache is freed) but keep their tokens; after
                :meth:`continue_generation` they are re-prefilled and go on. ``"in_place"``:
                stop stepping and keep the batch and its KV cache as it is.
        """
        if mode not in _PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(_PAUSE_MODES)}, got {mode!r}")
        checked = cast(PauseMode, mode)
        for rank in self._ranks:
            rank.scheduler.call(partial(rank.scheduler.pause, checked))

    def continue_generation(self) -> None:
        """Resume after :meth:`pause_generation` (every rank)."""
        for rank in self._ranks:
            rank.scheduler.call(partial(setattr, rank.scheduler, "paused", False))

    def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort one request by id, or all (on every rank); return how many were aborted."""
        if not abort_all and rid is None:
            raise ValueError("give a rid or abort_all=True")
        total = 0
        for rank in self._ranks:
            sched = rank.scheduler
            if abort_all:
                total += sched.call(partial(sched.abort_all, "aborted by request"))
            else:
                total += int(sched.call(partial(sched.abort, cast(str, rid))))
        return total

    def flush_cache(self) -> bool:
        """Drop the prefix cache and free KV memory on every rank; refused (False) while any
        request is in flight, as in SGLang. Weight updates drop the prefix cache themselves."""

        def flush() -> bool:
            if any(r.scheduler.running or r.scheduler.waiting for r in self._ranks):
                return False
            for r in self._ranks:
                assert r.scheduler.flush_cache()
            return True

        return self._with_ranks_stopped(flush)

    def _with_ranks_stopped(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this thread while every rank's scheduler waits between two steps.

        Ranks share the weights, so an update must not overlap any rank's forward pass; while
        parked, a rank's scheduler state may be touched from here.
        """
        with self._control_lock:
            arrived = [threading.Event() for _ in self._ranks]
            release = threading.Event()

            def park(event: threading.Event) -> None:
                event.set()
                release.wait()

            futures = [r.scheduler.post(partial(park, e)) for r, e in zip(self._ranks, arrived)]
            try:
                for event in arrived:
                    event.wait()
                with torch.inference_mode():
                    return fn()
            finally:
                release.set()
                for f in futures:
                    f.result()

    # ---- weights -----------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        """The version of the weights served now."""
        return self._weight_version

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        """Set the weight version string without touching weights.

        Requests in flight are not aborted unless asked (SGLang's endpoint aborts them all by
        default; Miles keeps them on purpose: an async RL loop would otherwise throw away every
        partial group at each update). Their later tokens report the new version.
        """
        if not isinstance(new_version, str):
            raise ValueError(f"weight_version must be a string, got {new_version!r}")
        if abort_all_requests:
            self.abort_request(abort_all=True)

        def apply() -> None:
            self._weight_version = new_version

        self._with_ranks_stopped(apply)

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Copy tensors (HF names) into the served weights, all or nothing.

        Every name, shape and dtype is checked before anything is written; on error the old
        weights and version stay and the engine keeps serving. Tensors are cast to the
        engine's dtype. The update runs between two decode steps: requests in flight continue
        with the new weights (their earlier tokens came from the old ones; see
        ``GenerateOutput.output_weight_versions``). Both names of tied embeddings are accepted.

        Args:
            named_tensors: ``(name, tensor)`` pairs.
            weight_version: the new version string, if given.
            flush_cache: drop the prefix cache (KV computed with the old weights), as SGLang's
                ``flush_cache`` after an update; requests in flight keep their own KV but do
                not enter the cache. ``False`` keeps stale entries (SGLang's behaviour too).
            abort_all_requests: abort every request first (default: they continue).

        Raises:
            ValueError: unknown names, wrong shapes or non-float dtypes (all listed).
        """
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a string, got {weight_version!r}")
        items = list(named_tensors)
        if abort_all_requests:
            self.abort_request(abort_all=True)

        def apply() -> None:
            pairs = prepare_update(self._params, items, self.dtype)
            for dst, src in pairs:
                dst.copy_(src)
            if self._quant is not None:
                self._quant.refresh(dst for dst, _ in pairs)
            for rank in self._ranks:
                rank.runner.mark_weights_changed()
                if flush_cache:
                    rank.scheduler.invalidate_cache()
                    if not (rank.scheduler.running or rank.scheduler.waiting):
                        rank.runner.release()
            if weight_version is not None:
                self._weight_version = weight_version

        self._with_ranks_stopped(apply)

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> None:
        """Load every ``*.safetensors`` tensor of a checkpoint directory (all or nothing).

        The files are read on the calling thread, so generation goes on meanwhile; only the
        copy pauses it. ``model_path`` then reports the new directory.

        Raises:
            ValueError: a bad directory, or a bad tensor (see :meth:`update_weights_from_tensor`).
        """
        tensors = load_safetensors_dir(model_path)
        if abort_all_requests:
            self.abort_request(abort_all=True)
        self.update_weights_from_tensor(
            tensors, weight_version=weight_version, flush_cache=flush_cache
        )
        self.model_path = str(Path(model_path).resolve())

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Return ``{name: miles_transfer.tensor_digest(param)}`` (all names when ``None``).

        Raises:
            ValueError: unknown names.
        """
        wanted = list(self._param_names) if names is None else list(names)
        unknown = [n for n in wanted if n not in self._params]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:8]}")
        return self._scheduler.call(lambda: {n: tensor_digest(self._params[n]) for n in wanted})

    @property
    def quantized_weights(self) -> QuantizedWeights | None:
        """The low-precision weights served (``None`` without a quantized ``weight_format``)."""
        return self._quant

    def served_weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Digests of what is served: ``quantized.quantized_digest`` (codes, scales, global
        scale) for quantized parameters, ``tensor_digest`` for the others (all of the module's
        names when ``None``). Without a quantized format it equals :meth:`weights_checksum`;
        a trainer checks it with ``miles_rollout.quantized.served_digests``.

        Raises:
            ValueError: unknown names.
        """
        if self._quant is None:
            return self.weights_checksum(names)
        quant = self._quant
        wanted = list(self._param_names) if names is None else list(names)
        unknown = [n for n in wanted if n not in self._params]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:8]}")
        inside = set(quant.names)

        def digests() -> dict[str, str]:
            return {
                n: quantized_digest(quant.quantized(n))
                if n in inside
                else tensor_digest(self._params[n])
                for n in wanted
            }

        return self._scheduler.call(digests)

    # ---- info --------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/get_model_info`` fields plus a few of ours."""
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self._weight_version,
            "model_type": cfg.model_type,
            "is_moe": self.is_moe,
            "num_experts_per_tok": self._runner.top_k if self.is_moe else None,
            "num_hidden_layers": self._runner.num_layers,
            "architectures": list(getattr(cfg, "architectures", None) or []),
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "dtype": self.config.dtype,
            "weight_format": self._served_format(),
            "eos_token_ids": sorted(self.eos_token_ids),
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's ``/get_server_info`` fields that routers and drivers read."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.model_path,
            "dp_size": len(self._ranks),
            "tp_size": 1,
            "context_length": self.context_length,
            "max_running_requests": self.config.max_running_requests,
            "dtype": self.config.dtype,
            "weight_format": self._served_format(),
            "quantized_params": len(self._quant.names) if self._quant is not None else 0,
            "random_seed": self.config.seed,
            "disable_radix_cache": not self.config.enable_prefix_cache,
            "batch_invariant": all(r.runner.batch_invariant for r in self._ranks),
            "weight_version": self._weight_version,
            "version": __version__,
            "engine": "miles-rollout",
            "internal_states": [self._rank_state(r) for r in self._ranks],
        }

    def _served_format(self) -> str:
        return self._quant.format if self._quant is not None else self.config.dtype

    def _rank_state(self, rank: _Rank) -> dict[str, Any]:
        sched = rank.scheduler
        state: dict[str, Any] = {
            "dp_rank": rank.index,
            "num_running_reqs": len(sched.running),
            "num_waiting_reqs": len(sched.waiting),
            "num_in_flight_reqs": rank.in_flight,
            "paused": sched.paused,
            "num_generated_tokens": sched.generated_tokens,
            "num_prefill_tokens": sched.prefill_tokens,
            "num_prompt_tokens": sched.prompt_tokens,
            "num_cached_prompt_tokens": sched.cached_prompt_tokens,
            "cache_hit_rate": (
                sched.cached_prompt_tokens / sched.prompt_tokens if sched.prompt_tokens else 0.0
            ),
            "prefix_cache": rank.cache is not None,
        }
        if rank.cache is not None:
            st = rank.cache.stats
            state.update(
                {
                    "prefix_cache_tokens": st.cached_tokens,
                    "prefix_cache_capacity_tokens": st.capacity_tokens,
                    "prefix_cache_inserted_tokens": st.inserted_tokens,
                    "prefix_cache_evicted_tokens": st.evicted_tokens,
                    "prefix_cache_flushes": st.flushes,
                    "prefix_cache_reserved_tokens": st.reserved_tokens,
                    "prefix_cache_sessions": st.sessions,
                    "prefix_cache_reservations_refused": st.reservations_refused,
                    "prefix_cache_reservations_dropped": st.reservations_dropped,
                    "prefix_cache_reservations_expired": st.reservations_expired,
                }
            )
        return state

    def load(self) -> list[dict[str, int]]:
        """Per-rank load as SGLang's ``/get_load`` reports it."""
        out = []
        for r in self._ranks:
            waiting = len(r.scheduler.waiting)
            reqs = max(r.in_flight, len(r.scheduler.running) + waiting)
            out.append(
                {"dp_rank": r.index, "num_reqs": reqs, "num_waiting_reqs": waiting, "load": reqs}
            )
        return out

    def health(self) -> bool:
        """True while every rank's engine thread runs."""
        return all(r.scheduler.is_alive() for r in self._ranks)

    def shutdown(self) -> None:
        """Abort every request and stop the engine threads. Idempotent."""
        for r in self._ranks:
            r.scheduler.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _build_quantized(model: Any, config: EngineConfig) -> QuantizedWeights | None:
    fmt = config.quant_format
    if fmt is None:
        return None
    try:
        import miles_quant  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"engine.weight_format {config.weight_format!r} needs miles-quant: "
            "pip install 'miles-rollout[quant]' (or pip install miles-quant)"
        ) from e
    params = dict(model.named_parameters(remove_duplicate=False))
    selection = select_weights(
        params,
        fmt,
        keep_bf16=config.keep_bf16,
        keep_first_layers=config.keep_first_layers,
        keep_last_layers=config.keep_last_layers,
        quantize_only=config.quantize_only,
        num_layers=int(getattr(model.config, "num_hidden_layers", 0) or 0),
    )
    quant = QuantizedWeights(params, selection, config.torch_dtype)
    logger.info(
        "serving %d weights in %s (%d kept in %s)",
        len(selection.quantized),
        fmt,
        len(selection.kept),
        config.dtype,
    )
    return quant


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
