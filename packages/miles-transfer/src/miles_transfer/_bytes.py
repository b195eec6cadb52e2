"""Zero-copy access to a CPU tensor's bytes without numpy (torch does not depend on numpy)."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["byte_view"]


def byte_view(t: torch.Tensor) -> memoryview:
    """A read-only ``memoryview`` of a contiguous CPU tensor's bytes (native byte order).

    The view aliases the tensor's memory: keep ``t`` alive while the view is in use.
    """
    assert t.device.type == "cpu", t.device
    assert t.is_contiguous(), t.stride()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B").toreadonly()
