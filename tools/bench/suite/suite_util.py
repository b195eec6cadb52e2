"""Inputs and buffers shared by the benchmarks (imported by name: pytest puts this folder on
sys.path)."""

from __future__ import annotations

import functools
import os

import torch

# Input size per benchmark. 32 MiB of bf16: input plus output exceed the 32 MiB L3 of the CI
# machine, so the memcpy row is a DRAM figure, not a cache one (MILES_BENCH_MIB to change it).
MIB = float(os.environ.get("MILES_BENCH_MIB", "32"))
NUMEL = int(MIB * 2**20) // 2 // 1024 * 1024


@functools.cache
def bf16_weights(numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    """A weight-like bf16 tensor of ``numel`` elements as [rows, 1024], made once per process
    (shared: do not modify it)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel // 1024, 1024, generator=g) * 0.02).to(torch.bfloat16)


def prefaulted_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer written once (first-touch page faults would otherwise dominate)."""
    out = torch.empty_like(t)
    out.fill_(0)
    return out
