"""The embedded CPU inference engine: continuous batching with exact logprobs.

    engine = EngineConfig(model_path="/path/to/hf_dir").build()
    out = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=16))
    engine.shutdown()

One background thread owns the model (see ``_scheduler.py``); ``submit`` may be called from any
thread and many concurrent requests are decoded together. The engine is a
``miles_transfer.WeightReceiver``.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import random
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

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
from miles_rollout.sampling_params import SamplingParams
from miles_rollout.version import __version__
from miles_transfer import tensor_digest

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

_PAUSE_MODES = ("abort", "retract", "in_place")
# Default prefix-cache budget (keys and values of every layer); see EngineConfig.
_PREFIX_CACHE_DEFAULT_BYTES = 512 << 20
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
        self._weight_version = config.weight_version
        self._rng = random.Random(config.seed)
        runner = CausalLMRunner(
            model,
            max_batch=config.max_running_requests,
            context_length=ctx,
            kernel_backend=config.kernel_backend,
        )
        self.vocab_size = runner.vocab_size
        self._runner = runner
        self._prefix_cache: RadixCache | None = None
        if config.enable_prefix_cache:
            capacity = config.prefix_cache_tokens
            if capacity is None:
                per_token = runner.pool_bytes(1)
                capacity = max(_PREFIX_CACHE_DEFAULT_BYTES // per_token, 2 * ctx)
            self._prefix_cache = RadixCache(capacity)
        self._scheduler = Scheduler(
            runner,
            max_running=config.max_running_requests,
            tokenizer=self.tokenizer,
            weight_version=lambda: self._weight_version,
            num_threads=config.num_threads,
            prefix_cache=self._prefix_cache,
        )

    # ---- generation --------------------------------------------------------------------------

    def submit(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> Future[GenerateOutput]:
        """Queue one request; return a future for its output. Thread-safe.

        Cancelling the future drops the request from the batch.

        Raises:
            ValueError: an empty prompt, token ids outside the vocabulary, a prompt that does
                not fit the context length, or stop strings without a tokenizer.
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
        )
        self._scheduler.add(req)
        return fut

    def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> GenerateOutput:
        """Generate and wait (blocking); see :meth:`submit`."""
        return self.submit(
            input_ids, sampling_params, return_logprob=return_logprob, rid=rid
        ).result()

    async def async_generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> GenerateOutput:
        """Generate without blocking the event loop; see :meth:`submit`."""
        fut = self.submit(input_ids, sampling_params, return_logprob=return_logprob, rid=rid)
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
        self._scheduler.call(lambda: self._scheduler.pause(checked))

    def continue_generation(self) -> None:
        """Resume after :meth:`pause_generation`."""

        def resume() -> None:
            self._scheduler.paused = False

        self._scheduler.call(resume)

    def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort one request by id, or all; return how many were aborted."""
        if abort_all:
            return self._scheduler.call(lambda: self._scheduler.abort_all("aborted by request"))
        if rid is None:
            raise ValueError("give a rid or abort_all=True")
        return int(self._scheduler.call(lambda: self._scheduler.abort(rid)))

    def flush_cache(self) -> bool:
        """Drop the prefix cache and free KV memory; refused (False) while requests are in
        flight, as in SGLang. Weight updates drop the prefix cache themselves."""
        return self._scheduler.call(self._scheduler.flush_cache)

    # ---- weights -----------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        """The version of the weights served now."""
        return self._weight_version

    def update_weight_version(self, new_version: str) -> None:
        """Set the weight version string without touching weights."""
        if not isinstance(new_version, str):
            raise ValueError(f"weight_version must be a string, got {new_version!r}")

        def apply() -> None:
            self._weight_version = new_version

        self._scheduler.call(apply)

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
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

        Raises:
            ValueError: unknown names, wrong shapes or non-float dtypes (all listed).
        """
        if weight_version is not None and not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a string, got {weight_version!r}")
        items = list(named_tensors)

        def apply() -> None:
            pairs = prepare_update(self._params, items, self.dtype)
            for dst, src in pairs:
                dst.copy_(src)
            self._runner.mark_weights_changed()
            if weight_version is not None:
                self._weight_version = weight_version
            if flush_cache:
                self._scheduler.invalidate_cache()
                if not (self._scheduler.running or self._scheduler.waiting):
                    self._runner.release()

        self._scheduler.call(apply)

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
        wanted = list(self._params) if names is None else list(names)
        unknown = [n for n in wanted if n not in self._params]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:8]}")
        return self._scheduler.call(lambda: {n: tensor_digest(self._params[n]) for n in wanted})

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
            "architectures": list(getattr(cfg, "architectures", None) or []),
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "dtype": self.config.dtype,
            "eos_token_ids": sorted(self.eos_token_ids),
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's ``/get_server_info`` fields that routers and drivers read."""
        sched = self._scheduler
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.model_path,
            "dp_size": 1,
            "tp_size": 1,
            "context_length": self.context_length,
            "max_running_requests": self.config.max_running_requests,
            "dtype": self.config.dtype,
            "random_seed": self.config.seed,
            "disable_radix_cache": self._prefix_cache is None,
            "batch_invariant": self._runner.batch_invariant,
            "weight_version": self._weight_version,
            "version": __version__,
            "engine": "miles-rollout",
            "internal_states": [
                {
                    "num_running_reqs": len(sched.running),
                    "num_waiting_reqs": len(sched.waiting),
                    "paused": sched.paused,
                    "num_generated_tokens": sched.generated_tokens,
                    "num_prefill_tokens": sched.prefill_tokens,
                    "num_prompt_tokens": sched.prompt_tokens,
                    "num_cached_prompt_tokens": sched.cached_prompt_tokens,
                    "cache_hit_rate": (
                        sched.cached_prompt_tokens / sched.prompt_tokens
                        if sched.prompt_tokens
                        else 0.0
                    ),
                    **self._cache_state(),
                }
            ],
        }

    def _cache_state(self) -> dict[str, Any]:
        cache = self._prefix_cache
        if cache is None:
            return {"prefix_cache": False}
        st = cache.stats
        return {
            "prefix_cache": True,
            "prefix_cache_tokens": st.cached_tokens,
            "prefix_cache_capacity_tokens": st.capacity_tokens,
            "prefix_cache_inserted_tokens": st.inserted_tokens,
            "prefix_cache_evicted_tokens": st.evicted_tokens,
            "prefix_cache_flushes": st.flushes,
        }

    def health(self) -> bool:
        """True while the engine thread runs."""
        return self._scheduler.is_alive()

    def shutdown(self) -> None:
        """Abort every request and stop the engine thread. Idempotent."""
        self._scheduler.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
