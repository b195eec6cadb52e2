"""Configuration of the embedded engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from miles_rollout.engine import Engine

__all__ = ["EngineConfig"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How to build an embedded CPU :class:`~miles_rollout.Engine`.

    Attributes:
        model_path: a local HF checkpoint directory (``config.json`` plus ``*.safetensors``);
            the tokenizer is loaded from the same directory when its files are there.
        dtype: the precision the engine serves and computes in: ``"float32"`` or
            ``"bfloat16"``. Logits are always turned into logprobs in float32.
        max_running_requests: the most requests decoded together in one batch; more wait.
        context_length: the most tokens (prompt plus output) one request may hold. ``None``
            takes the model's ``max_position_embeddings``; a larger value is rejected.
        seed: seeds the engine's random stream, from which every request without its own
            ``SamplingParams.seed`` draws one.
        num_threads: intra-op threads of the engine thread (prefill and decode). ``None``
            keeps torch's setting for new threads (normally one per core). The setting is
            the engine thread's own: the rest of the process, a trainer in the same process
            for instance, keeps its thread count. For small models decoding is bound by
            per-op overhead and one thread is as fast as two, and a second OpenMP team would
            spin on the cores the trainer needs next.
        weight_version: the version string reported with the initial weights.
        kernel_backend: the engine's kernels (attention, and RMSNorm for bf16): ``"auto"``
            (the C++ kernels of ``miles_rollout._ext`` when they are built, else PyTorch
            ops), ``"native"`` (the kernels, or a ``ValueError`` at build time if they are
            missing) or ``"torch"`` (PyTorch ops only). Both compute transformers' eager bf16
            maths: RMSNorm bit for bit, attention outputs equal or 1 bf16 ulp apart (see
            ``_decode_attention.py``). In float32 the kernel's attention makes the engine
            batch invariant (a token's logprob does not depend on what it was batched with,
            nor on a prefix-cache hit; see ``_model.py``); without it float32 runs SDPA.
        dp_size: data-parallel ranks in this engine: each has its own scheduler thread,
            batch of ``max_running_requests``, KV cache and prefix cache; the weights are
            shared (each rank keeps its own fused copies of the q/k/v and gate/up
            projections). A request runs on the rank it names (``data_parallel_rank``), else
            on its session's rank, else on the least loaded one. With ``num_threads=None``
            the ranks split the cores (``torch.get_num_threads() // dp_size`` each).
        enable_prefix_cache: keep finished requests' KV in a radix tree over token ids and
            reuse the longest cached prefix of each new request (SGLang's radix cache;
            ``--disable-radix-cache`` there). Weight updates drop it.
        session_reservation: keep each multi-turn session's cached history reserved between
            its turns (sessions are keyed by ``X-SMG-Routing-Key`` / ``routing_key``), with
            admission control and the eviction policy in ``_prefix_cache.py``; off: plain
            LRU.
        session_ttl_s: a session's reservation expires this long after its last turn.
        prefix_cache_tokens: the prefix cache's capacity in tokens. ``None``: as many as
            512 MiB of keys and values (all layers, the engine dtype) hold, at least twice
            the context length. Memory is taken as the cache fills, not up front.
        weight_format: the precision the weights are served in (``miles_rollout.quantized``):
            ``None`` (the engine dtype), ``"bf16"`` / ``"fp32"`` (unquantized; must agree
            with ``dtype``), or a miles-quant format: ``"fp8_block128"``, ``"mxfp8"``,
            ``"nvfp4"``, ``"mxfp4"``, ``"int4_g32"``, ``"int4_g128"``. The engine quantizes
            what it receives at every weight update and computes with the dequantized values
            in ``dtype`` (weight-only quantization). A format or shape it cannot serve is a
            ``ValueError`` at build time.
        keep_bf16: parameter patterns served unquantized, in ``dtype`` (globs on a parameter
            or module name, or ``"re:"`` + a regex, as in miles-quant's exporter). Embeddings,
            ``lm_head``, norms, MoE routers and biases are always kept. A pattern that matches
            no parameter is a ``ValueError``.
        keep_first_layers: serve the first N transformer layers unquantized.
        keep_last_layers: serve the last N transformer layers unquantized.
        quantize_only: if set, quantize only parameters matching one of these patterns (e.g.
            ``["*.experts.*"]`` for W4A16 experts next to INT4 QAT).
    """

    model_path: str
    dtype: str = "float32"
    max_running_requests: int = 64
    context_length: int | None = None
    seed: int = 0
    num_threads: int | None = None
    weight_version: str = "0"
    kernel_backend: str = "auto"
    dp_size: int = 1
    enable_prefix_cache: bool = True
    prefix_cache_tokens: int | None = None
    session_reservation: bool = True
    session_ttl_s: float = 300.0
    weight_format: str | None = None
    keep_bf16: list[str] = field(default_factory=list)
    keep_first_layers: int = 0
    keep_last_layers: int = 0
    quantize_only: list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a non-empty string, got {self.model_path!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_running_requests < 1:
            raise ValueError(
                f"max_running_requests must be at least 1, got {self.max_running_requests}"
            )
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {self.context_length}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version must be a string, got {self.weight_version!r}")
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1, got {self.dp_size!r}")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 1:
            raise ValueError(
                f"prefix_cache_tokens must be at least 1 (or None for the default), got "
                f"{self.prefix_cache_tokens}; use enable_prefix_cache=False to turn it off"
            )
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be positive, got {self.session_ttl_s}")
        self._check_weight_format()
        if self.kernel_backend not in ("auto", "native", "torch"):
            raise ValueError(
                "kernel_backend must be one of ['auto', 'native', 'torch'], got "
                f"{self.kernel_backend!r}"
            )

    def _check_weight_format(self) -> None:
        from miles_rollout.quantized import resolve_format

        fmt = resolve_format(self.weight_format, self.dtype)
        for name in ("keep_first_layers", "keep_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("keep_bf16", "quantize_only"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"{name} takes a list of patterns, got the string {value!r}")
            if value is not None:
                setattr(self, name, list(value))
        if self.quantize_only is not None and not self.quantize_only:
            raise ValueError("quantize_only must name at least one pattern (or be None)")
        layer_flags = bool(
            self.keep_bf16
            or self.keep_first_layers
            or self.keep_last_layers
            or self.quantize_only is not None
        )
        if fmt is None and layer_flags:
            raise ValueError(
                "keep_bf16 / keep_first_layers / keep_last_layers / quantize_only choose which "
                f"weights stay unquantized, but weight_format is {self.weight_format!r} "
                "(nothing is quantized); set a quantized weight_format or drop them"
            )

    @property
    def quant_format(self) -> str | None:
        """The miles-quant format served (``None``: unquantized)."""
        from miles_rollout.quantized import resolve_format

        return resolve_format(self.weight_format, self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by :attr:`dtype`."""
        return _DTYPES[self.dtype]

    def build(self) -> Engine:
        """Load the model and start the engine (see :class:`~miles_rollout.Engine`)."""
        from miles_rollout.engine import Engine

        return Engine(self)
