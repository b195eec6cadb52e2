"""A fast step-by-step forward pass for Llama-style HF models over a slot-based KV cache.

Why not call the HF model: for the small models a CPU rollout runs, the per-call overhead of
``model.forward`` (mask construction, cache objects, many small ops) costs as much as the
matmuls. This module reads the weights of the loaded HF module directly (so a weight update of
the HF parameters is seen here after :meth:`CausalLMRunner.refresh_weights`), fuses the q/k/v
and gate/up projections, and keeps one pre-allocated KV cache in which every running request
owns one row ("slot"), plus a token pool for the prefix cache (``_prefix_cache.py``). The
maths follows ``transformers``' Qwen3 / Qwen2 / Llama code exactly (RMSNorm in float32, HF's
rotary tables), so logprobs match a teacher-forced HF forward pass up to float rounding (see the
package README for the measured tolerance).

Batch invariance (float32 with the native kernel): a token's KV and logits get the same bits
whether it is computed in a prefill of any width, beside any other requests, in a decode step,
or after a prefix-cache hit. Attention runs per query token over exactly its row's live
positions (``_decode_attention.py``), and every GEMM gets its rows padded to a multiple of
``_ROW_ALIGN``: MKL's sgemm gives a row the same bits for any row count then, but rounds rows
of 1-3-row products (and 2-thread splits of 5-7 or 9-11 rows) differently (measured here; the
engine checks it per weight shape at start-up and gives up the claim if it fails).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from miles_rollout._decode_attention import BACKENDS as _ATTENTION_BACKENDS
from miles_rollout._decode_attention import eager_attention as _eager_attention
from miles_rollout._decode_attention import native_decode_attention as _native_attention
from miles_rollout._decode_attention import native_error, native_supported
from miles_rollout._moe import MoeWeights, is_moe_layer, moe_forward
from miles_rollout._rms_norm import native_rms_norm, native_rms_norm_is_exact
from miles_rollout._rms_norm import torch_rms_norm as _rms

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLMRunner"]

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe")
# Rope types whose tables do not change with the sequence length at run time.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The KV cache grows in steps of this many positions (and doubles past it).
_T_ALIGN = 128
# Batch-invariant GEMMs: row counts padded to a multiple of this (see the module docstring).
_ROW_ALIGN = 4
# The prefix cache's token pool starts at this many slots and doubles up to its capacity.
_POOL_START = 1024


def check_supported(config: Any) -> None:
    """Raise ``ValueError`` if the runner cannot serve this HF config exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the embedded engine; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}. Serve other models with SGLang and use "
            "SGLangClient."
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(
        config, "use_sliding_window", False
    ):
        raise ValueError("sliding-window attention is not supported by the embedded engine")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {list(_STATIC_ROPE_TYPES)}"
        )


Served = Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Layer:
    """The tensors of one decoder layer, in the layout the fast forward wants."""

    __slots__ = (
        "bo",
        "bqkv",
        "down",
        "down_b",
        "down_p",
        "gate_up",
        "gate_up_b",
        "gate_up_p",
        "in_eps",
        "in_w",
        "k_norm",
        "moe",
        "o",
        "o_p",
        "post_eps",
        "post_w",
        "q_norm",
        "qk_eps",
        "qk_norm",
        "wqkv",
        "wqkv_p",
    )

    def __init__(self, layer: Any, pack: _Packer, served: Served = _same) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        w = served  # the tensor computed with for an HF weight (see quantized.py)
        self.in_w: torch.Tensor = layer.input_layernorm.weight
        self.in_eps: float = layer.input_layernorm.variance_epsilon
        self.post_w: torch.Tensor = layer.post_attention_layernorm.weight
        self.post_eps: float = layer.post_attention_layernorm.variance_epsilon
        self.wqkv = torch.cat([w(attn.q_proj.weight), w(attn.k_proj.weight), w(attn.v_proj.weight)])
        self.bqkv = (
            torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            if attn.q_proj.bias is not None
            else None
        )
        self.o: torch.Tensor = w(attn.o_proj.weight)
        self.bo: torch.Tensor | None = attn.o_proj.bias
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        self.q_norm: torch.Tensor | None = q_norm.weight if q_norm is not None else None
        self.k_norm: torch.Tensor | None = k_norm.weight if k_norm is not None else None
        self.qk_eps: float = q_norm.variance_epsilon if q_norm is not None else 0.0
        # One weight row per q head then per kv head, to normalise q and k in one op.
        self.qk_norm: torch.Tensor | None = (
            torch.cat(
                [
                    q_norm.weight.expand(attn.config.num_attention_heads, -1),
                    k_norm.weight.expand(attn.config.num_key_value_heads, -1),
                ]
            )
            if q_norm is not None and k_norm is not None
            else None
        )
        # Pre-packed copies for decode (None: use the plain weight).
        self.wqkv_p = pack(self.wqkv)
        self.o_p = pack(self.o)
        self.moe: MoeWeights | None = MoeWeights(mlp, w) if is_moe_layer(mlp) else None
        if self.moe is not None:
            self.gate_up = self.down = torch.empty(0)
            self.gate_up_b = self.down_b = self.gate_up_p = self.down_p = None
            return
        self.gate_up = torch.cat([w(mlp.gate_proj.weight), w(mlp.up_proj.weight)])
        self.gate_up_b = (
            torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            if mlp.gate_proj.bias is not None
            else None
        )
        self.down = w(mlp.down_proj.weight)
        self.down_b = mlp.down_proj.bias
        self.gate_up_p = pack(self.gate_up)
        self.down_p = pack(self.down)


def _eager_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal `_eager_attention` over ``q [m, H, W, D]``, ``k``/``v`` ``[m, KV, W, D]``."""
    m, nh, width, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    future = torch.ones(width, width, dtype=torch.bool).triu_(1)  # [W, W]
    # Head h reads kv head h // g: stack each group's g heads along the query axis.
    q_grouped = q.reshape(m, nkv, g, width, hd)
    o = _eager_attention(q_grouped, k[:, :, None], v[:, :, None], scale, future)
    return o.reshape(m, nh, width, hd)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Decode batches are small (one row per running request): oneDNN's GEMM for a plain weight
# re-lays the weight out on every call, which costs as much as the product at these sizes.
# Pre-packed once per weight version, bf16 decode GEMMs run 1.4-1.9x faster with the same bits
# (checked per weight shape below, falling back to ``F.linear`` if they ever differ).
_PACK_ROWS_HINT = 64


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _Packer:
    """Packs bf16 weights for `_packed_linear`, once it has proven bit-identical per shape."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.enabled = dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
        self._exact: dict[tuple[int, int], bool] = {}

    def __call__(self, w: torch.Tensor) -> torch.Tensor | None:
        if not self.enabled:
            return None
        shape = (int(w.shape[0]), int(w.shape[1]))
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
            if shape not in self._exact:
                gen = torch.Generator().manual_seed(0)
                bias = torch.randn(shape[0], generator=gen).to(w.dtype)
                self._exact[shape] = all(
                    torch.equal(F.linear(p, w, bias), _packed_linear(p, packed, bias))
                    for rows in (1, 7, _PACK_ROWS_HINT)
                    for p in [torch.randn(rows, shape[1], generator=gen).to(w.dtype)]
                )
        except (RuntimeError, AttributeError):  # no oneDNN op in this torch build
            self.enabled = False
            return None
        return packed if self._exact[shape] else None


def _dlinear(
    x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    return F.linear(x, w, b) if packed is None else _packed_linear(x, packed, b)


def _aligned_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with the rows padded to a multiple of ``_ROW_ALIGN`` (batch invariance)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = -m % _ROW_ALIGN
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = F.linear(rows, w, b)
    return (out[:m] if pad else out).reshape(*x.shape[:-1], w.shape[0])


def _rows_are_invariant(w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether padded products give every row the same bits for any row count (this thread)."""
    gen = torch.Generator().manual_seed(int(w.shape[0]) * 7919 + int(w.shape[1]))
    x = torch.randn(24, w.shape[1], generator=gen).to(w.dtype)
    ref = torch.cat([_aligned_linear(x[i : i + _ROW_ALIGN], w, bias) for i in range(0, 24, 4)])
    return all(
        torch.equal(_aligned_linear(x[off : off + m], w, bias), ref[off : off + m])
        for m in (1, 3, 5, 9, 13, 21)
        for off in (0, 3)
        if off + m <= 24
    )


class CausalLMRunner:
    """Prefill and decode for a batch of requests, each owning one row of the KV cache.

    Row ``i`` of the cache holds the keys/values of request ``i`` at positions
    ``0 .. len_i - 1``; positions past a row's length hold garbage and are masked out.
    All methods must be called from one thread under ``torch.inference_mode()``.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int,
        context_length: int,
        kernel_backend: str = "auto",
        served: Served = _same,
    ) -> None:
        """Args: the HF model, cache limits, the backend of the bf16 kernels, and ``served``:
        the tensor to compute with for an HF weight (a dequantized copy under a low-precision
        ``weight_format``; see ``quantized.py``; default: the weight itself).

        ``kernel_backend``: ``"auto"`` (the native kernels of ``miles_rollout._ext`` for bf16
        when they are built, else PyTorch), ``"native"`` (required: ``ValueError`` if they
        cannot run) or ``"torch"`` (always PyTorch ops). The kernels are the decode attention
        and RMSNorm; RMSNorm is used only for row sizes where it was checked to give PyTorch's
        bits. float32 always runs PyTorch ops (SDPA attention).
        """
        check_supported(model.config)
        if kernel_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {list(_ATTENTION_BACKENDS)}, got {kernel_backend!r}"
            )
        cfg = model.config
        self.model = model
        self._served = served
        self.dtype: torch.dtype = next(model.parameters()).dtype
        # Low precision: transformers' eager attention maths (the trainer's for bf16 on CPU),
        # so that rollout and training compute the same logprobs; float32 keeps SDPA.
        self._eager_attention = self.dtype != torch.float32
        self.max_batch = max_batch
        self.context_length = context_length
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or (
            cfg.hidden_size // cfg.num_attention_heads
        )
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.scale: float = model.model.layers[0].self_attn.scaling
        self._q_size = self.num_heads * self.head_dim
        # bf16 decode attention in C++ (native/rollout): the same maths as _eager_attention,
        # equal outputs or 1-ulp differences (see _decode_attention.py), 5-6x faster per layer.
        native_ok = native_supported(self.dtype, self.head_dim)
        if kernel_backend == "native" and not native_ok:
            raise ValueError(
                "kernel_backend='native' needs the miles_rollout._ext kernels, a bfloat16 "
                f"model and head_dim % 16 == 0 (got {self.dtype}, head_dim {self.head_dim}; "
                f"extension: {native_error() or 'loaded'}). Use kernel_backend='auto'."
            )
        self.native_attention: bool = native_ok and kernel_backend != "torch"
        # float32 with the kernel: every token computed the same way (see the module docstring);
        # confirmed per weight shape in refresh_weights.
        self.batch_invariant: bool = self.native_attention and self.dtype == torch.float32
        # RMSNorm in one pass per row instead of ~8 PyTorch ops (19 norms per decode step for
        # 6 layers), for the row sizes where the kernel gives PyTorch's bits here.
        self._native_norm_sizes: frozenset[int] = frozenset(
            size
            for size, eps in self._norm_shapes(model)
            if self.native_attention
            and self.dtype == torch.bfloat16
            and native_rms_norm_is_exact(size, eps)
        )
        self._kv_size = self.num_kv_heads * self.head_dim
        with torch.inference_mode():
            dummy = torch.zeros(1, dtype=torch.float32)
            positions = torch.arange(context_length)[None]
            cos, sin = model.model.rotary_emb(dummy, positions)
            self._cos = cos[0].to(self.dtype)
            self._sin = sin[0].to(self.dtype)
        self._pack = _Packer(self.dtype)
        self._layers: list[_Layer] = []
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._batch_cap = 0
        self._token_cap = 0
        self._pool_k: list[torch.Tensor] = []  # per layer [slots, KV, D]: the prefix cache
        self._pool_v: list[torch.Tensor] = []
        self._checked_shapes: set[tuple[int, int]] = set()
        self.refresh_weights()
        # MoE: each position's top-k expert ids per layer (-1 for dense layers), kept beside
        # the KV (rows, pool) so that a request's routing survives compaction and cache hits.
        moe = [layer.moe for layer in self._layers if layer.moe is not None]
        self.is_moe = bool(moe)
        self.top_k = moe[0].top_k if moe else 0
        self.num_layers = len(self._layers)
        self._routes: torch.Tensor | None = None  # [B, T, layers, top_k] int32
        self._pool_routes: torch.Tensor | None = None  # [slots, layers, top_k] int32
        self._capture: torch.Tensor | None = None  # the current forward's [N, layers, top_k]

    @staticmethod
    def _norm_shapes(model: Any) -> list[tuple[int, float]]:
        inner = model.model
        shapes = {(int(inner.norm.weight.shape[-1]), float(inner.norm.variance_epsilon))}
        for layer in inner.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                shapes.add((int(norm.weight.shape[-1]), float(norm.variance_epsilon)))
            q_norm = getattr(layer.self_attn, "q_norm", None)
            if q_norm is not None:
                shapes.add((int(q_norm.weight.shape[-1]), float(q_norm.variance_epsilon)))
        return sorted(shapes)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[-1] in self._native_norm_sizes:
            out = native_rms_norm(x, w, eps)
            if out is not None:
                return out
        return _rms(x, w, eps)

    # ---- weights ---------------------------------------------------------------------------

    def mark_weights_changed(self) -> None:
        """Note that the HF parameters changed; the next forward rebuilds from them.

        A weight update arrives in several buckets; rebuilding (fusing and packing every
        weight) once before the next forward instead of after every bucket.
        """
        self._stale = True

    def refresh_weights(self) -> None:
        """Rebuild the fused projections from the HF module (after any weight update)."""
        self._stale = False
        with torch.inference_mode():
            inner = self.model.model
            self._embed: torch.Tensor = inner.embed_tokens.weight
            self._norm_w: torch.Tensor = inner.norm.weight
            self._norm_eps: float = inner.norm.variance_epsilon
            self._lm_head: torch.Tensor = self.model.get_output_embeddings().weight
            self._lm_head_p = self._pack(self._lm_head)
            self._layers = [_Layer(layer, self._pack, self._served) for layer in inner.layers]

    def _check_invariance(self) -> None:
        """Give up batch invariance if a weight shape's GEMM rows depend on the row count.

        Runs before the first forward, on the thread that runs forwards (MKL's row splitting
        depends on that thread's OpenMP team).
        """
        weights: list[tuple[torch.Tensor, torch.Tensor | None]] = [(self._lm_head, None)]
        for layer in self._layers:
            weights += [(layer.wqkv, layer.bqkv), (layer.o, layer.bo)]
            if layer.moe is not None:
                moe = layer.moe
                weights += [(moe.router, None), (moe.gate_up[0], None), (moe.down[0], None)]
            else:
                weights += [(layer.gate_up, layer.gate_up_b), (layer.down, layer.down_b)]
        for w, b in weights:
            shape = (int(w.shape[0]), int(w.shape[1]))
            if shape in self._checked_shapes:
                continue
            if not _rows_are_invariant(w, b):
                logger.warning(
                    "GEMM rows of shape %s depend on the row count in this torch build; the "
                    "engine is not batch invariant (prefix-cache hits and batching change "
                    "logprobs at float rounding level)",
                    shape,
                )
                self.batch_invariant = False
                return
            self._checked_shapes.add(shape)

    # ---- cache -----------------------------------------------------------------------------

    def ensure_capacity(self, batch: int, tokens: int) -> None:
        """Grow the KV cache to hold ``batch`` rows of ``tokens`` positions (keeps contents)."""
        assert batch <= self.max_batch, (batch, self.max_batch)
        assert tokens <= self.context_length, (tokens, self.context_length)
        if batch <= self._batch_cap and tokens <= self._token_cap:
            return
        new_b = self._batch_cap
        if batch > new_b:
            new_b = min(self.max_batch, max(batch, 2 * new_b, 8))
        new_t = self._token_cap
        while new_t < tokens:
            new_t = max(_T_ALIGN, 2 * new_t)
        new_t = min(new_t, self.context_length)
        shape = (new_b, self.num_kv_heads, new_t, self.head_dim)
        old_b, old_t = self._batch_cap, self._token_cap
        for cache in (self._k, self._v):
            for i in range(len(self._layers)):
                fresh = torch.zeros(shape, dtype=self.dtype)
                if i < len(cache):
                    fresh[:old_b, :, :old_t] = cache[i]
                    cache[i] = fresh
                else:
                    cache.append(fresh)
        if self.is_moe:
            routes = torch.full((new_b, new_t, self.num_layers, self.top_k), -1, dtype=torch.int32)
            if self._routes is not None:
                routes[:old_b, :old_t] = self._routes
            self._routes = routes
        self._batch_cap, self._token_cap = new_b, new_t

    def release(self) -> None:
        """Free the KV cache memory (only when no request is running)."""
        self._k, self._v = [], []
        self._routes = None
        self._batch_cap = self._token_cap = 0

    def copy_rows(self, dst: list[int], src: list[int], length: int) -> None:
        """Copy positions ``0 .. length-1`` of cache rows ``src`` onto rows ``dst``."""
        if not dst:
            return
        d, s = torch.tensor(dst), torch.tensor(src)
        for cache in (self._k, self._v):
            for t in cache:
                t[d, :, :length] = t[s, :, :length]
        if self._routes is not None:
            self._routes[d, :length] = self._routes[s, :length]

    def routes(self, row: int, length: int) -> torch.Tensor:
        """The expert ids of positions ``0 .. length-1`` of ``row``: int32 ``[length, layers,
        top_k]`` (a copy)."""
        assert self._routes is not None
        return self._routes[row, :length].clone()

    # ---- prefix-cache pool -----------------------------------------------------------------

    def ensure_pool(self, slots: int) -> None:
        """Grow the prefix cache's token pool to at least ``slots`` tokens (keeps contents)."""
        have = self._pool_k[0].shape[0] if self._pool_k else 0
        if slots <= have:
            return
        new = max(slots, _POOL_START, 2 * have)
        shape = (new, self.num_kv_heads, self.head_dim)
        for pool in (self._pool_k, self._pool_v):
            for i in range(len(self._layers)):
                fresh = torch.zeros(shape, dtype=self.dtype)
                if i < len(pool):
                    fresh[:have] = pool[i]
                    pool[i] = fresh
                else:
                    pool.append(fresh)
        if self.is_moe:
            routes = torch.full((new, self.num_layers, self.top_k), -1, dtype=torch.int32)
            if self._pool_routes is not None:
                routes[:have] = self._pool_routes
            self._pool_routes = routes

    def pool_bytes(self, slots: int) -> int:
        """Memory of ``slots`` pool tokens (keys and values of every layer)."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self._layers) * slots * self._kv_size * itemsize

    def release_pool(self) -> None:
        """Free the prefix cache's pool memory."""
        self._pool_k, self._pool_v = [], []
        self._pool_routes = None

    def save_to_pool(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Copy KV positions ``start .. start + len(slots) - 1`` of ``row`` into pool slots."""
        self.ensure_pool(int(slots.max()) + 1)
        end = start + slots.shape[0]
        for cache, pool in ((self._k, self._pool_k), (self._v, self._pool_v)):
            for c, p in zip(cache, pool):
                p[slots] = c[row, :, start:end].transpose(0, 1)
        if self._routes is not None and self._pool_routes is not None:
            self._pool_routes[slots] = self._routes[row, start:end]

    def load_from_pool(self, row: int, slots: torch.Tensor) -> None:
        """Copy pool slots into KV positions ``0 .. len(slots) - 1`` of ``row``."""
        n = slots.shape[0]
        self.ensure_capacity(row + 1, n)
        for cache, pool in ((self._k, self._pool_k), (self._v, self._pool_v)):
            for c, p in zip(cache, pool):
                c[row, :, :n] = p[slots].transpose(0, 1)
        if self._routes is not None and self._pool_routes is not None:
            self._routes[row, :n] = self._pool_routes[slots]

    # ---- forward ---------------------------------------------------------------------------

    def prefill(
        self, first_row: int, prompts: list[list[int]], starts: list[int] | None = None
    ) -> torch.Tensor:
        """Run ``prompts`` into rows ``first_row ..``; return float32 logits at each last token.

        ``starts[i]`` positions of row ``first_row + i`` already hold the KV of
        ``prompts[i][:starts[i]]`` (copied from the prefix cache); only the rest is computed,
        attending to them. Without starts (and without batch invariance), prompts are
        right-padded to a common length and run with causal attention: no real position
        attends to a pad position, so no padding mask is needed, and the cache keeps the pad
        positions as garbage past each row's length.
        """
        self._before_forward()
        starts = [0] * len(prompts) if starts is None else starts
        if not any(starts) and not self.batch_invariant:
            return self._prefill_fresh(first_row, prompts)
        m = len(prompts)
        news = [len(p) - s for p, s in zip(prompts, starts)]
        assert min(news) >= 1, (news, starts)
        width = max(news)
        ends = [len(p) for p in prompts]
        self.ensure_capacity(first_row + m, max(ends))
        ids = torch.zeros(m, width, dtype=torch.long)
        for i, (p, s) in enumerate(zip(prompts, starts)):
            ids[i, : len(p) - s] = torch.tensor(p[s:], dtype=torch.long)
        start_t = torch.tensor(starts)
        end_t = torch.tensor(ends)
        # Position of each (row, column); pad columns repeat the row's last position.
        pos = torch.minimum(start_t[:, None] + torch.arange(width)[None, :], end_t[:, None] - 1)
        real = (torch.arange(width)[None, :] < torch.tensor(news)[:, None]).reshape(-1)
        rows = (first_row + torch.arange(m))[:, None].expand(m, width).reshape(-1)
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # Flat index of (real token, kv head) in a [B * KV * T, D] view of a layer's cache.
        flat = (
            ((rows[real] * nkv)[:, None] + torch.arange(nkv)[None, :]) * self._token_cap
            + pos.reshape(-1)[real][:, None]
        ).reshape(-1)
        cos = self._cos[pos][:, :, None, :]  # [m, W, 1, D]
        sin = self._sin[pos][:, :, None, :]
        x = F.embedding(ids, self._embed)  # [m, W, hidden]
        qk_size = self._q_size + self._kv_size
        self._capture = self._new_capture(m * width)
        for li, layer in enumerate(self._layers):
            h = self._norm(x, layer.in_w, layer.in_eps)
            qkv = self._linear(h, layer.wqkv, layer.bqkv)
            qk = qkv[..., :qk_size].view(m, width, nh + nkv, hd)
            if layer.qk_norm is not None:
                qk = self._norm(qk, layer.qk_norm, layer.qk_eps)
            qk = _rope(qk, cos, sin)  # [m, W, H + KV, D]
            k = qk[:, :, nh:].reshape(m * width, nkv, hd)
            v = qkv[..., qk_size:].reshape(m * width, nkv, hd)
            kc, vc = self._k[li], self._v[li]
            kc.view(-1, hd).index_copy_(0, flat, k[real].reshape(-1, hd))
            vc.view(-1, hd).index_copy_(0, flat, v[real].reshape(-1, hd))
            q = qk[:, :, :nh].reshape(m * width, nkv, nh // nkv, hd)
            if self.native_attention and (self.batch_invariant or self.dtype == torch.float32):
                o = _native_attention(q, kc, vc, pos.reshape(-1) + 1, self.scale, rows)
            else:
                o = self._masked_prefill_attention(q, li, first_row, m, width, pos)
            x = x + self._linear(o.reshape(m, width, self._q_size), layer.o, layer.bo)
            x = x + self._mlp(x, layer, li=li)
        if self._routes is not None and self._capture is not None:
            where = rows[real] * self._token_cap + pos.reshape(-1)[real]
            self._routes.view(-1, self.num_layers * self.top_k).index_copy_(
                0, where, self._capture[real].reshape(-1, self.num_layers * self.top_k)
            )
        last = x[torch.arange(m), torch.tensor(news) - 1]  # [m, hidden]
        return self._logits(last)

    def _masked_prefill_attention(
        self, q: torch.Tensor, li: int, first_row: int, m: int, width: int, pos: torch.Tensor
    ) -> torch.Tensor:
        """PyTorch attention of prefill queries over their rows' cached and new positions."""
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        t = int(pos.max()) + 1
        k = self._k[li][first_row : first_row + m, :, :t]  # [m, KV, T, D]
        v = self._v[li][first_row : first_row + m, :, :t]
        visible = torch.arange(t)[None, None, :] <= pos[:, :, None]  # [m, W, T]
        q = q.reshape(m, width, nh, hd).transpose(1, 2)  # [m, H, W, D]
        if self._eager_attention:
            g = nh // nkv
            qg = q.reshape(m, nkv, g * width, hd)
            hidden = ~visible[:, None].repeat(1, 1, g, 1)  # [m, 1, G * W, T]
            o = _eager_attention(qg, k, v, self.scale, hidden).reshape(m, nh, width, hd)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible[:, None], scale=self.scale, enable_gqa=nh != nkv
            )
        return o.transpose(1, 2).reshape(m * width, nkv, nh // nkv, hd)

    def _prefill_fresh(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        m = len(prompts)
        lens = [len(p) for p in prompts]
        width = max(lens)
        self.ensure_capacity(first_row + m, width)
        ids = torch.zeros(m, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        x = F.embedding(ids, self._embed)  # [m, W, hidden]
        cos = self._cos[:width]
        sin = self._sin[:width]
        rows = slice(first_row, first_row + m)
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        self._capture = self._new_capture(m * width)
        for li, layer in enumerate(self._layers):
            h = self._norm(x, layer.in_w, layer.in_eps)
            qkv = F.linear(h, layer.wqkv, layer.bqkv)
            q = qkv[..., : self._q_size].view(m, width, nh, hd)
            k = qkv[..., self._q_size : self._q_size + self._kv_size].view(m, width, nkv, hd)
            v = qkv[..., self._q_size + self._kv_size :].view(m, width, nkv, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = self._norm(q, layer.q_norm, layer.qk_eps)
                k = self._norm(k, layer.k_norm, layer.qk_eps)
            q = _rope(q.transpose(1, 2), cos, sin)  # [m, H, W, D]
            k = _rope(k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            self._k[li][rows, :, :width] = k
            self._v[li][rows, :, :width] = v
            if self._eager_attention:
                o = _eager_prefill_attention(q, k, v, self.scale)
            else:
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=nh != nkv
                )
            o = o.transpose(1, 2).reshape(m, width, self._q_size)
            x = x + F.linear(o, layer.o, layer.bo)
            x = x + self._mlp(x, layer, li=li)
        if self._routes is not None and self._capture is not None:
            self._routes[rows, :width] = self._capture.view(m, width, -1, self.top_k)
        last = x[torch.arange(m), torch.tensor(lens) - 1]  # [m, hidden]
        return self._logits(last)

    def _before_forward(self) -> None:
        if self._stale:
            self.refresh_weights()
        if self.batch_invariant and not self._checked_shapes:
            self._check_invariance()

    def _linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.batch_invariant:
            return _aligned_linear(x, w, b)
        return _dlinear(x, w, packed, b)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        """One decode step for rows ``0 .. n-1``; return float32 logits ``[n, vocab]``.

        Args:
            tokens: ``[n]`` the token fed to each row (its last sampled token).
            positions: ``[n]`` where that token goes (the row's current length).
            max_len: ``max(positions) + 1`` (passed in to avoid a tensor-to-Python sync).
        """
        self._before_forward()
        n = tokens.shape[0]
        self.ensure_capacity(n, max_len)
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qk_size = self._q_size + self._kv_size
        x = F.embedding(tokens, self._embed)  # [n, hidden]
        cos = self._cos[positions][:, None, :]  # [n, 1, D]
        sin = self._sin[positions][:, None, :]
        if self.native_attention:
            lengths = positions + 1  # the kernel reads each row's live positions only
        else:
            mask = (torch.arange(max_len)[None, :] <= positions[:, None])[:, None, None, :]
            hidden_BKQT = ~mask  # [n, 1, 1, T]: cache positions past each row's length
        # Flat row index of (request, kv head, position) in a [B * KV * T, D] view of the cache:
        # one index_copy_ per layer writes the new keys (and values) of every request.
        slot = torch.arange(n)[:, None] * nkv + torch.arange(nkv)[None, :]
        flat = (slot * self._token_cap + positions[:, None]).reshape(-1)
        self._capture = self._new_capture(n)
        for li, layer in enumerate(self._layers):
            h = self._norm(x, layer.in_w, layer.in_eps)
            qkv = self._linear(h, layer.wqkv, layer.bqkv, layer.wqkv_p)
            qk = qkv[:, :qk_size].view(n, nh + nkv, hd)
            if layer.qk_norm is not None:
                qk = self._norm(qk, layer.qk_norm, layer.qk_eps)
            qk = _rope(qk, cos, sin)
            kc, vc = self._k[li], self._v[li]
            kc.view(-1, hd).index_copy_(0, flat, qk[:, nh:].reshape(-1, hd))
            vc.view(-1, hd).index_copy_(0, flat, qkv[:, qk_size:].reshape(-1, hd))
            # Grouped-query attention without copies: the G query heads that share a kv head
            # act as G query positions against it (no causal mask among them).
            q = qk[:, :nh].reshape(n, nkv, nh // nkv, hd)
            if self.native_attention:
                # Operands are the runner's own (checked once when the extension was chosen).
                o = _native_attention(q, kc, vc, lengths, self.scale)
            else:
                k, v = kc[:n, :, :max_len], vc[:n, :, :max_len]
                if self._eager_attention:
                    o = _eager_attention(q, k, v, self.scale, hidden_BKQT)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            x = x + self._linear(o.reshape(n, self._q_size), layer.o, layer.bo, layer.o_p)
            x = x + self._mlp(x, layer, packed=True, li=li)
        if self._routes is not None and self._capture is not None:
            self._routes[torch.arange(n), positions] = self._capture
        return self._logits(x, packed=True)

    def _new_capture(self, n: int) -> torch.Tensor | None:
        if not self.is_moe:
            return None
        return torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.int32)

    def _mlp(
        self, x: torch.Tensor, layer: _Layer, *, packed: bool = False, li: int = 0
    ) -> torch.Tensor:
        h = self._norm(x, layer.post_w, layer.post_eps)
        if layer.moe is not None:
            flat = h.reshape(-1, h.shape[-1])
            out, experts = moe_forward(flat, layer.moe, self._linear)
            if self._capture is not None:
                self._capture[:, li] = experts
            return out.reshape(h.shape)
        gate_up_p, down_p = (layer.gate_up_p, layer.down_p) if packed else (None, None)
        gate, up = self._linear(h, layer.gate_up, layer.gate_up_b, gate_up_p).chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, layer.down, layer.down_b, down_p)

    def _logits(self, x: torch.Tensor, *, packed: bool = False) -> torch.Tensor:
        x = self._norm(x, self._norm_w, self._norm_eps)
        return self._linear(x, self._lm_head, None, self._lm_head_p if packed else None).float()
