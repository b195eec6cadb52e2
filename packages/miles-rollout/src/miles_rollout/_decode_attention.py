"""Attention over the engine's slot KV cache: the native kernel and its PyTorch reference.

Each query token attends to positions ``0 .. length-1`` of one row of the layer's cache: one
new token per running request in decode (row b), or every token of a prefill (``rows`` maps
each query token to its request's row). In bf16 the numerics are transformers' eager bf16
attention (what the trainer computes): scores ``bf16(q . k)`` with float32 accumulation,
``bf16(score * scale)``, softmax in float32 over the row's live positions, probabilities
rounded to bf16, output ``bf16(sum_t p_t * v_t)``. In float32 the kernel does the same
operations without the bf16 roundings; there its point is that a token's output depends only
on its own query and its row's live positions, never on the batch, the padding or the cache
size, so a token gets the same bits in a prefill, a decode step or after a prefix-cache hit
(the engine's batch invariance rests on it; PyTorch's SDPA and softmax round differently for
different key counts).

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


_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def native_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the native kernel is loaded and handles this dtype and head size."""
    return _native.ext is not None and dtype in _KERNEL_DTYPES and head_dim % 16 == 0


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    rows: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of ``n`` query tokens, each over the live positions of one cache row.

    Args:
        q: ``[n, KV, G, D]`` queries (any strides with the last dimension contiguous); query
            head ``h * G + g`` reads kv head ``h``.
        k_cache: ``[B, KV, T, D]`` contiguous; query ``b`` reads row ``rows[b]`` (row ``b``
            when ``rows`` is None, then ``B >= n``) at positions ``0 .. lengths[b] - 1``
            (later positions are never read).
        v_cache: like ``k_cache``.
        lengths: ``[n]`` int64, each in ``[1, T]``.
        scale: the score scale (``head_dim ** -0.5`` for these models).
        rows: ``[n]`` int64 cache rows in ``[0, B)``, or None.
        backend: ``"auto"``, ``"native"`` or ``"torch"`` (see the module docstring).

    Returns:
        A new contiguous ``[n, KV, G, D]`` tensor in ``q``'s dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes or strides, a length outside ``[1, T]`` or an
            unknown backend; ``backend="native"`` when the kernel is missing or does not apply.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    _check(q, k_cache, v_cache, lengths, rows)
    d = q.shape[-1]
    native = native_supported(q.dtype, d)
    if backend == "native" and not native:
        raise ValueError(
            "backend='native' needs the miles_rollout._ext kernel, bfloat16 or float32 and a "
            "head_dim that "
            f"is a multiple of 16 (got {q.dtype}, head_dim {d}; extension: "
            f"{native_error() or 'loaded'}). Reinstall miles-rollout with a C++ compiler, or "
            "use backend='auto'."
        )
    if backend == "torch" or not native:
        return _torch_decode_attention(q, k_cache, v_cache, lengths, scale, rows)
    return native_decode_attention(q, k_cache, v_cache, lengths, scale, rows)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and the caches must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}")
    n, nkv, _, d = q.shape
    b, kv_k, t, d_k = k.shape
    if k.shape != v.shape or kv_k != nkv or d_k != d or (rows is None and b < n):
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
    if rows is not None and (rows.dtype != torch.int64 or rows.shape != (n,)):
        raise ValueError(
            f"rows must be int64 of shape ({n},), got {rows.dtype} {tuple(rows.shape)}"
        )


def _torch_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    n = q.shape[0]
    width = int(lengths.max()) if n else 1
    if n and (int(lengths.min()) < 1 or width > k.shape[2]):
        raise ValueError(
            f"lengths {lengths.tolist()} reach outside [1, {k.shape[2]}] (the cache's positions)"
        )
    if rows is not None and n and (int(rows.min()) < 0 or int(rows.max()) >= k.shape[0]):
        raise ValueError(f"rows {rows.tolist()} reach outside [0, {k.shape[0]}) (the cache's rows)")
    hidden = (torch.arange(width)[None, :] >= lengths[:, None])[:, None, None, :]
    if rows is None:
        return eager_attention(q, k[:n, :, :width], v[:n, :, :width], scale, hidden)
    return eager_attention(q, k[rows, :, :width], v[rows, :, :width], scale, hidden)


def native_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel itself, without :func:`decode_attention`'s operand checks (the engine's hot
    path, whose operands are its own). The extension must be loaded; lengths and rows are
    still checked by the kernel (``ValueError``)."""
    ext = _native.ext
    assert ext is not None
    n, nkv, g, d = q.shape
    out = torch.empty((n, nkv, g, d), dtype=q.dtype)
    lens = lengths.contiguous()
    rows_c = rows.contiguous() if rows is not None else None
    try:
        ext.decode_attention(
            q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
            k.data_ptr(), v.data_ptr(), k.shape[2], lens.data_ptr(),
            n, nkv, g, d, scale, out.data_ptr(),
            rows_c.data_ptr() if rows_c is not None else 0, k.shape[0],
            _KERNEL_DTYPES[q.dtype],
        )  # fmt: skip
    except ValueError as exc:  # a length or row out of range: say which, in the caller's terms
        raise ValueError(str(exc).replace("miles_rollout._ext.decode_attention: ", "")) from None
    return out
