"""Bit-exact tensor digests: the cheap equality check between trainer and engine weights."""

from __future__ import annotations

import hashlib

import torch

from miles_transfer._bytes import byte_view

__all__ = ["tensor_digest"]


def tensor_digest(t: torch.Tensor) -> str:
    """Return a BLAKE2b-128 hex digest of a tensor's dtype, shape and raw bytes.

    Two tensors have the same digest iff they have the same dtype, the same shape and equal
    bits (so ``-0.0`` and ``0.0`` differ, and NaN payloads count). The tensor is copied to CPU
    and made contiguous first; it is not modified.

    Args:
        t: any dense tensor (any dtype, any device).

    Returns:
        32 hex characters.
    """
    cpu = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{cpu.dtype}|{tuple(cpu.shape)}|".encode())
    h.update(byte_view(cpu))
    return h.hexdigest()
