"""miles-transfer's per-update work vs its bounds: digests and delta encoding.

Groups (32 MiB of bf16 weights by default, one thread, buffers reused):
- digest: ``tensor_digest`` (BLAKE2b-128 over dtype, shape and bytes: what every verified update
  computes per tensor) vs ``hashlib.blake2b`` over the same bytes (the hash alone) vs a memcpy;
- delta encode: ``delta.codec.encode_chunk`` (compare, compact the 1.6% changed elements,
  zstd; the native kernel when built) vs a memcpy of the new version's bytes (what a full
  update would move instead).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from suite_util import MIB, NUMEL, bf16_weights, prefaulted_like

from miles_transfer import tensor_digest

CHANGED = 0.0164  # fraction of elements an RL step changes in bf16 (docs/benchmarks.md)


@pytest.mark.benchmark(group=f"digest ({MIB:g} MiB bf16)")
@pytest.mark.parametrize("method", ["tensor_digest", "hashlib blake2b", "memcpy"])
def test_digest(benchmark, method):
    t = bf16_weights()
    if method == "tensor_digest":
        benchmark(tensor_digest, t)
    elif method == "hashlib blake2b":
        raw = memoryview(t.view(torch.uint8).numpy())
        benchmark(lambda: hashlib.blake2b(raw, digest_size=16).digest())
    else:
        benchmark(prefaulted_like(t).copy_, t)


@pytest.mark.benchmark(group=f"delta encode ({MIB:g} MiB bf16, 1.6% changed)")
@pytest.mark.parametrize("method", ["encode_chunk", "memcpy"])
def test_delta_encode(benchmark, method):
    pytest.importorskip("xxhash", reason="the [delta] extra")
    from miles_transfer.delta.codec import encode_chunk

    g = torch.Generator().manual_seed(1)
    base = bf16_weights().reshape(-1)
    new = base.clone()
    hit = torch.rand(NUMEL, generator=g) < CHANGED
    new[hit] = (base[hit].float() * 1.01).to(torch.bfloat16)
    b16, n16 = base.view(torch.int16), new.view(torch.int16)
    if method == "encode_chunk":
        patch = encode_chunk(0, b16, n16, "xor")
        assert patch is not None
        assert patch.layout == "sparse"
        benchmark(encode_chunk, 0, b16, n16, "xor")
    else:
        benchmark(prefaulted_like(new).copy_, new)
