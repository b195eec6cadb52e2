"""The native kernels' work split: native equals the reference bit for bit where it matters.

The AVX-512 kernels walk a matrix in pieces: FP8 tiles in chunks of a few tiles of one tile row
(the amax pass of the next chunk interleaved with the cast of the current one, a prefetch
cursor running ahead across chunks and tile rows), block formats in batches of 16 blocks, and
the tensor-level amax (NVFP4 global scale, FP8 per tensor) in a pass of its own. These tests
put tile, chunk, batch and thread boundaries everywhere: several tile rows, rows that end in a
partial chunk and a partial tile, stacked matrices, one or three threads, and poisoned (NaN /
Inf) and all-zero tiles next to ordinary ones, in every input dtype."""

from __future__ import annotations

import pytest
import torch
from _quant_testlib import assert_same_quantized, format_cases, require_native

import miles_quant as mq

CASES = format_cases()
IDS = [f"{f}-{g}-{r}" for f, g, r in CASES]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _matrix(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, poison: bool = True
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    # Magnitudes that change along the row and down the columns, so tiles get different scales.
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, k)
    x = x * torch.logspace(-1, 1, shape[-2]).unsqueeze(-1)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    m = x.view(-1, shape[-2], k)
    n = shape[-2]
    m[0, 128:n, 256:512] = 0  # an all-zero 128x128 tile (partial in rows): its scale is tiny
    if poison:
        m[0, n - 1, k - 1] = float("inf")  # in the last, partial tile of the last tile row
        m[-1, 3, 5] = float("nan")  # poisons its tile, block and the whole matrix's global scale
    return x


def _check(x: torch.Tensor, fmt: str, gran: str, rule: str | None, stacked: bool = False) -> None:
    require_native()
    kw = {"granularity": gran, "scale_rule": rule, "stacked": stacked}
    ref = mq.quantize(x, fmt, backend="torch", **kw)  # type: ignore[arg-type]
    for threads in (1, 3):  # three threads split the rows (or tile rows) unevenly
        nat = mq.quantize(x, fmt, backend="native", threads=threads, **kw)  # type: ignore[arg-type]
        assert_same_quantized(nat, ref)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_walk_native_equals_reference(
    fmt: str, gran: str, rule: str | None, dtype: torch.dtype
) -> None:
    # 300 rows: two full 128-row tile rows and a partial one; 1100 = 8 full 128-wide tiles and
    # a partial one, 68 blocks of 16 + 12; 4100 columns: more than 16 tiles or 256 blocks a row.
    # Without NaN / Inf too: a poisoned value poisons a tensor-level scale (NVFP4, FP8 tensor).
    for shape in ((300, 1100), (130, 4100)):
        for poison in (True, False):
            _check(_matrix(shape, dtype, seed=shape[1], poison=poison), fmt, gran, rule)


@pytest.mark.parametrize(("fmt", "gran", "rule"), CASES, ids=IDS)
def test_stacked_chunked_walk_native_equals_reference(
    fmt: str, gran: str, rule: str | None
) -> None:
    # Three [200, 700] experts: tile rows of one expert end at row 200, not at a multiple of
    # 128, and the walk (and the prefetch cursor) continues into the next expert.
    stacked = gran in ("tensor", "1x16", "16x16")
    _check(_matrix((3, 200, 700), torch.bfloat16, seed=5), fmt, gran, rule, stacked=stacked)
