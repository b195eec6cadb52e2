"""Walk a model's full (unsharded) state in HF names, and cut a tensor stream into buckets."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["bucketize", "iter_full_state"]

# Name segments that wrappers insert between HF names (torch.compile, activation checkpointing,
# FSDP1). FSDP2's fully_shard keeps names unchanged; these are stripped so the names stay HF names.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _hf_name(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(t, DTensor)


def iter_full_state(
    module: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every entry of ``module.state_dict()``, in its order.

    Sharded entries (FSDP2 ``DTensor``) are gathered with ``full_tensor()``, one tensor at a
    time, so at most one full tensor is materialised per step. **That gather is a collective:
    every rank of the mesh must run this iterator to the end, in the same order, even ranks that
    send nothing** (see ``push_module_weights``, which does this for you). Plain modules work too.

    Wrapper segments (``_orig_mod.``, ``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.``)
    are removed from names, so they are the HF names of the unwrapped model.

    Args:
        module: any module, sharded with FSDP2 or not.
        dtype: if given, floating-point tensors are cast to it; other dtypes are left alone.
            The cast happens before the gather (bit-identical to casting after, fewer bytes
            moved), so every rank must pass the same ``dtype``.

    Yields:
        ``(name, tensor)`` with ``tensor`` detached, dense and unsharded, on the shard's device.
    """
    for name, t in module.state_dict().items():
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if _is_dtensor(t):
            t = t.full_tensor()
        yield _hf_name(name), t.detach()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into consecutive buckets of at most ``bucket_bytes`` bytes.

    Order is kept. A tensor larger than ``bucket_bytes`` goes alone in its own bucket. The input
    is consumed lazily, so only one bucket is held at a time.

    Args:
        named_tensors: ``(name, tensor)`` pairs.
        bucket_bytes: the size limit of a bucket (> 0).

    Yields:
        Non-empty lists of pairs.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        n = _nbytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
