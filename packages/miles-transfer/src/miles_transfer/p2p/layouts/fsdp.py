"""FSDP2's layout: every parameter sharded along dim 0 the way `fully_shard` does.

`fsdp_layout` follows `torch.chunk`: rank r holds rows [r*c, min((r+1)*c, n)) with
c = ceil(n / world_size); ranks past the end hold an empty shard. `shard_dim0` applies the same
rule to the local tensors of any layout (FSDP over TP = 2-D parallelism).
"""

from __future__ import annotations

from collections.abc import Mapping

from miles_transfer.p2p.layouts.base import Layout, LocalTensor, ParamSpec, Piece, make_layout
from miles_transfer.p2p.layouts.models import replicated_layout

__all__ = ["fsdp_layout", "shard_dim0"]


def _chunk(n: int, ws: int, r: int) -> tuple[int, int]:
    """torch.chunk's split of n rows over ws ranks: rank r's [start, stop)."""
    c = -(-n // ws) if n else 0
    start = min(n, r * c)
    return start, min(n, start + c)


def shard_dim0(layout: Layout, world_size: int, *, kind: str | None = None) -> Layout:
    """Shard every local tensor of every rank along dim 0 over world_size ranks (FSDP2 rule).

    New rank `r * world_size + i` holds rows `_chunk(rows, world_size, i)` of old rank r's local
    tensors (the FSDP mesh dimension is the fastest). 0-d tensors stay whole on every shard.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ranks: list[dict[str, LocalTensor]] = []
    for old in layout.ranks:
        for i in range(world_size):
            new: dict[str, LocalTensor] = {}
            for name, lt in old.tensors:
                if not lt.shape:
                    new[name] = lt
                    continue
                a, b = _chunk(lt.shape[0], world_size, i)
                new[name] = LocalTensor((b - a, *lt.shape[1:]), lt.dtype, _cut_rows(lt, a, b))
            ranks.append(new)
    return make_layout(kind or f"{layout.kind}+fsdp(ws={world_size})", layout.param_specs(), ranks)


def _cut_rows(lt: LocalTensor, a: int, b: int) -> tuple[Piece, ...]:
    """The pieces of lt restricted to local rows [a, b), re-based to row 0."""
    out = []
    for p in lt.pieces:
        lead = len(lt.shape) - len(p.size)
        lo, hi = p.local_start[0], p.local_start[0] + p.local_size()[0]
        lo2, hi2 = max(lo, a), min(hi, b)
        if lo2 >= hi2:
            continue
        if lead:  # row dim is an extra (stack) dimension: the HF box is unchanged
            out.append(Piece(p.name, p.full_start, p.size, (lo2 - a, *p.local_start[1:])))
            continue
        fs = (p.full_start[0] + lo2 - lo, *p.full_start[1:])
        out.append(Piece(p.name, fs, (hi2 - lo2, *p.size[1:]), (lo2 - a, *p.local_start[1:])))
    return tuple(out)


def fsdp_layout(params: Mapping[str, ParamSpec], world_size: int) -> Layout:
    """FSDP2 (`fully_shard`, Shard(0)) over world_size ranks; local names are HF names."""
    return shard_dim0(replicated_layout(params, 1), world_size, kind=f"fsdp(ws={world_size})")
