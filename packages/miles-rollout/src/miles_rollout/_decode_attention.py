"""bf16 decode attention over the engine's slot KV cache: the native kernel and its reference.

One new query token per running request attends to its own row of the layer's cache. The
numerics are transformers' eager bf16 attention (what the trainer computes): scores
``bf16(q . k)`` with float32 accumulation, ``bf16(score * scale)``, softmax in float32 over
the row's live positions, probabilities rounded to bf16, output ``bf16(sum_t p_t * v_t)``.

``decode_attention(..., backend="auto" | "native" | "torch")``: ``native`` is the C++ kernel
of ``miles_rollout._ext`` (``native/rollout``), ``torch`` the PyTorch reference
(``_eager_attention`` over the cache with a length mask, the engine's path without the
extension), ``auto`` the kernel when it is built and applies, else the reference. Both give
equal outputs or differ by 1 bf16 ulp where a float32 sum or exp lands on a rounding boundary
(the kernel and oneDNN add in different orders, and the kernel has its own exp); the package
tests measure it.
"""

from __future__ import annotations

import torch

from miles_rollout import _native

__all__ = [
    "decode_attention",
    "eager_attention",
    "native_decode_attention",
    "native_error",
    "native_supported",
]

BACKENDS = ("auto", "native", "torch")


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, hidden: torch.Tensor
) -> torch.Tensor:
    """transformers' eager attention maths: ``softmax_fp32((q @ k^T) * scale) @ v``.

    Scores are computed and rounded in the compute dtype, softmax runs in float32 and its
    output is cast back, exactly as ``eager_attention_forward`` does and as the trainer does
    for bf16 on CPU. Shapes: ``q [B, KV, Q, D]``, ``k``/``v`` ``[B, KV, T, D]``, ``hidden``
    broadcastable to ``[B, KV, Q, T]`` (True = masked out); returns ``[B, KV, Q, D]``.
    """
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    s = s.masked_fill(hidden, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def native_error() -> str | None:
    """Why the native kernel is unavailable (None when it is built and loaded)."""
    return _native.error


def native_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the native kernel is loaded and handles this dtype and head size."""
    return _native.ext is not None and dtype == torch.bfloat16 and head_dim % 16 == 0


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of one query token per row over rows ``0 .. n-1`` of a layer's KV cache.

    Args:
        q: ``[n, KV, G, D]`` queries (any strides with the last dimension contiguous); query
            head ``h * G + g`` reads kv head ``h``.
        k_cache: ``[B, KV, T, D]`` contiguous, ``B >= n``; row ``b`` holds its keys at
            positions ``0 .. lengths[b] - 1`` (later positions are never read).
        v_cache: like ``k_cache``.
        lengths: ``[n]`` int64, each in ``[1, T]``.
        scale: the score scale (``head_dim ** -0.5`` for these models).
        backend: ``"auto"``, ``"native"`` or ``"torch"`` (see the module docstring).

    Returns:
        A new contiguous ``[n, KV, G, D]`` tensor in ``q``'s dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes or strides, a length outside ``[1, T]`` or an
            unknown backend; ``backend="native"`` when the kernel is missing or does not apply.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    _check(q, k_cache, v_cache, lengths)
    d = q.shape[-1]
    native = native_supported(q.dtype, d)
    if backend == "native" and not native:
        raise ValueError(
            "backend='native' needs the miles_rollout._ext kernel, bfloat16 and a head_dim that "
            f"is a multiple of 16 (got {q.dtype}, head_dim {d}; extension: "
            f"{native_error() or 'loaded'}). Reinstall miles-rollout with a C++ compiler, or "
            "use backend='auto'."
        )
    if backend == "torch" or not native:
        return _torch_decode_attention(q, k_cache, v_cache, lengths, scale)
    return native_decode_attention(q, k_cache, v_cache, lengths, scale)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and the caches must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}")
    n, nkv, _, d = q.shape
    b, kv_k, t, d_k = k.shape
    if k.shape != v.shape or kv_k != nkv or d_k != d or b < n:
        raise ValueError(
            f"cache shapes {tuple(k.shape)} / {tuple(v.shape)} do not fit q {tuple(q.shape)}: "
            "need [B >= n, KV, T, D] for both"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (k.is_contiguous() and v.is_contiguous()) or q.stride(-1) != 1:
        raise ValueError("the caches must be contiguous and q's last dimension contiguous")
    if lengths.dtype != torch.int64 or lengths.shape != (n,):
        raise ValueError(
            f"lengths must be int64 of shape ({n},), got {lengths.dtype} {tuple(lengths.shape)}"
        )
    if n and t < 1:
        raise ValueError("the caches hold no positions")


def _torch_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    n = q.shape[0]
    width = int(lengths.max()) if n else 1
    if n and (int(lengths.min()) < 1 or width > k.shape[2]):
        raise ValueError(
            f"lengths {lengths.tolist()} reach outside [1, {k.shape[2]}] (the cache's positions)"
        )
    hidden = (torch.arange(width)[None, :] >= lengths[:, None])[:, None, None, :]
    return eager_attention(q, k[:n, :, :width], v[:n, :, :width], scale, hidden)


def native_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """The kernel itself, without :func:`decode_attention`'s operand checks (the engine's hot
    path, whose operands are its own). The extension must be loaded; lengths are still checked
    by the kernel (``ValueError``)."""
    ext = _native.ext
    assert ext is not None
    n, nkv, g, d = q.shape
    out = torch.empty((n, nkv, g, d), dtype=q.dtype)
    lens = lengths.contiguous()
    try:
        ext.decode_attention(
            q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
            k.data_ptr(), v.data_ptr(), k.shape[2], lens.data_ptr(),
            n, nkv, g, d, scale, out.data_ptr(),
        )  # fmt: skip
    except ValueError as exc:  # a length outside [1, T]: say which, in the caller's terms
        raise ValueError(str(exc).replace("miles_rollout._ext.decode_attention: ", "")) from None
    return out
