"""The transfer planner: which box of which source shard each destination rank needs.

`plan_transfer(src, dst)` intersects every destination piece with the source pieces of the same
HF parameter and emits one `CopyOp` per intersection: a box copied from a source rank's local
tensor into a destination rank's local tensor. Where several source ranks hold the same data
(replicated norms, DP replicas, a tied embedding kept on two stages) exactly one is used, chosen
round-robin by destination rank to spread the load; so every byte a destination needs is moved
exactly once and nothing else is moved (`bytes_moved(d) == bytes_needed(d)`).

A `CopyOp` is a strided box in both local tensors; `strided()` gives its byte-level form (offsets
and strides, contiguous dimensions merged) and `byte_runs()` the contiguous byte ranges it reads
and writes. Plans are cached by the layouts' fingerprints, so re-planning each step is free.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product

from miles_transfer.p2p.layouts.base import Layout, LocalTensor, Piece

__all__ = ["CopyOp", "Strided", "TransferPlan", "clear_plan_cache", "plan_transfer"]

_CACHE_SIZE = 16


@dataclass(frozen=True, slots=True)
class Strided:
    """A byte-level strided copy: `shape` bytes-box, offsets and strides in bytes.

    The last dimension is contiguous on both sides (stride 1); dimensions that are contiguous
    across each other on both sides are merged.
    """

    src_offset: int
    dst_offset: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy the box `size` (HF coordinates) from a source local tensor to a destination one.

    Attributes:
        name: the HF parameter the box belongs to.
        full_start: where the box starts in the HF parameter.
        size: the box extent (HF rank).
        src_rank, src_name, src_shape, src_start: the source rank, local tensor, its shape and
            where the box starts in it (local rank).
        dst_rank, dst_name, dst_shape, dst_start: the same for the destination.
        itemsize: bytes per element.
    """

    name: str
    full_start: tuple[int, ...]
    size: tuple[int, ...]
    src_rank: int
    src_name: str
    src_shape: tuple[int, ...]
    src_start: tuple[int, ...]
    dst_rank: int
    dst_name: str
    dst_shape: tuple[int, ...]
    dst_start: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def strided(self) -> Strided:
        """The byte-level form of this copy (offsets relative to each local tensor's start)."""
        src_st, dst_st = _row_major(self.src_shape), _row_major(self.dst_shape)
        src_off = sum(a * s for a, s in zip(self.src_start, src_st, strict=True)) * self.itemsize
        dst_off = sum(a * s for a, s in zip(self.dst_start, dst_st, strict=True)) * self.itemsize
        k = len(self.size)
        dims = [
            (n, ss * self.itemsize, ds * self.itemsize)
            for n, ss, ds in zip(self.size, src_st[len(src_st) - k :], dst_st[len(dst_st) - k :])
            if n != 1
        ]
        if not dims or dims[-1][1] != self.itemsize or dims[-1][2] != self.itemsize:
            dims.append((1, self.itemsize, self.itemsize))
        # The innermost dimension in bytes, then merge outward while contiguous on both sides.
        n, _, _ = dims.pop()
        merged = [(n * self.itemsize, 1, 1)]
        for n, ss, ds in reversed(dims):
            inner_n, inner_s, inner_d = merged[0]
            if ss == inner_n * inner_s and ds == inner_n * inner_d:
                merged[0] = (n * inner_n, inner_s, inner_d)
            else:
                merged.insert(0, (n, ss, ds))
        return Strided(
            src_off,
            dst_off,
            tuple(d[0] for d in merged),
            tuple(d[1] for d in merged),
            tuple(d[2] for d in merged),
        )

    def byte_runs(self) -> Iterator[tuple[int, int, int]]:
        """(source byte offset, destination byte offset, length) of each contiguous run."""
        s = self.strided()
        run = s.shape[-1]
        for idx in product(*(range(n) for n in s.shape[:-1])):
            so = s.src_offset + sum(i * st for i, st in zip(idx, s.src_strides, strict=False))
            do = s.dst_offset + sum(i * st for i, st in zip(idx, s.dst_strides, strict=False))
            yield so, do, run

    def split(self, max_bytes: int) -> list[CopyOp]:
        """This copy cut into pieces of at most max_bytes (along the outermost dims first).

        A single contiguous row longer than max_bytes stays whole only when it cannot be cut
        (never: the innermost dimension is cut element-wise as a last resort).
        """
        if self.nbytes <= max_bytes or not self.size:
            return [self]
        k = next((i for i, n in enumerate(self.size) if n > 1), None)
        if k is None:
            return [self]
        per = self.nbytes // self.size[k]
        if per > max_bytes:
            step = 1
        else:
            step = max(1, max_bytes // per)
        out: list[CopyOp] = []
        for a in range(0, self.size[k], step):
            n = min(step, self.size[k] - a)
            out.extend(self._slice(k, a, n).split(max_bytes))
        return out

    def _slice(self, k: int, a: int, n: int) -> CopyOp:
        def shift(start: tuple[int, ...], shape_rank: int) -> tuple[int, ...]:
            j = shape_rank - len(self.size) + k
            return (*start[:j], start[j] + a, *start[j + 1 :])

        return CopyOp(
            self.name,
            shift(self.full_start, len(self.size)),
            (*self.size[:k], n, *self.size[k + 1 :]),
            self.src_rank,
            self.src_name,
            self.src_shape,
            shift(self.src_start, len(self.src_shape)),
            self.dst_rank,
            self.dst_name,
            self.dst_shape,
            shift(self.dst_start, len(self.dst_shape)),
            self.itemsize,
        )


@dataclass(frozen=True)
class TransferPlan:
    """All copies from a source layout to a destination layout.

    Attributes:
        src, dst: the layouts.
        ops: every CopyOp, ordered by destination rank, then source rank, then destination
            tensor order.
    """

    src: Layout
    dst: Layout
    ops: tuple[CopyOp, ...]
    _buckets: dict[tuple[int, int, int], list[list[CopyOp]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def ops_between(self, src_rank: int, dst_rank: int) -> list[CopyOp]:
        return [o for o in self.ops if o.src_rank == src_rank and o.dst_rank == dst_rank]

    def ops_to(self, dst_rank: int) -> list[CopyOp]:
        return [o for o in self.ops if o.dst_rank == dst_rank]

    def sources_of(self, dst_rank: int) -> list[int]:
        """Source ranks that send something to dst_rank (ascending)."""
        return sorted({o.src_rank for o in self.ops if o.dst_rank == dst_rank})

    def targets_of(self, src_rank: int) -> list[int]:
        """Destination ranks that src_rank sends something to (ascending)."""
        return sorted({o.dst_rank for o in self.ops if o.src_rank == src_rank})

    def bytes_needed(self, dst_rank: int) -> int:
        """Bytes of HF data the destination rank holds in its layout (padding excluded)."""
        return self.dst.rank(dst_rank).needed_bytes()

    def bytes_moved(self, dst_rank: int) -> int:
        """Bytes the plan moves into dst_rank."""
        return sum(o.nbytes for o in self.ops if o.dst_rank == dst_rank)

    def buckets(self, src_rank: int, dst_rank: int, bucket_bytes: int) -> list[list[CopyOp]]:
        """The copies from src_rank to dst_rank grouped into buckets of at most bucket_bytes.

        Copies keep their order; a copy bigger than a bucket is split (`CopyOp.split`). Both
        ends of a transfer compute the same list, so messages need no headers.
        """
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        key = (src_rank, dst_rank, bucket_bytes)
        got = self._buckets.get(key)
        if got is not None:
            return got
        out: list[list[CopyOp]] = []
        cur: list[CopyOp] = []
        size = 0
        for op in self.ops_between(src_rank, dst_rank):
            for part in op.split(bucket_bytes):
                if cur and size + part.nbytes > bucket_bytes:
                    out.append(cur)
                    cur, size = [], 0
                cur.append(part)
                size += part.nbytes
        if cur:
            out.append(cur)
        self._buckets[key] = out
        return out


def _subtract(box: tuple[tuple[int, int], ...], cut: tuple[tuple[int, int], ...]) -> list:
    """box minus cut (cut inside box), as disjoint boxes; boxes are ((start, stop), ...)."""
    out = []
    rest = list(box)
    for k, ((a, b), (c, d)) in enumerate(zip(box, cut, strict=True)):
        if a < c:
            out.append((*rest[:k], (a, c), *rest[k + 1 :]))
        if d < b:
            out.append((*rest[:k], (d, b), *rest[k + 1 :]))
        rest[k] = (c, d)
    return out


def _plan(src: Layout, dst: Layout) -> TransferPlan:
    src_specs, dst_specs = src.param_specs(), dst.param_specs()
    sources: dict[str, list[tuple[int, str, LocalTensor, Piece]]] = {}
    for r, rank in enumerate(src.ranks):
        for local, lt in rank.tensors:
            for p in lt.pieces:
                sources.setdefault(p.name, []).append((r, local, lt, p))
    ops: list[CopyOp] = []
    for d, rank in enumerate(dst.ranks):
        for dlocal, dlt in rank.tensors:
            for dp in dlt.pieces:
                spec, have = dst_specs[dp.name], src_specs.get(dp.name)
                if have is None:
                    raise ValueError(
                        f"destination rank {d} needs {dp.name!r}, which the source layout "
                        f"({src.kind}) does not have; the layouts describe different models"
                    )
                if have != spec:
                    raise ValueError(
                        f"{dp.name!r} is {have.dtype}{list(have.shape)} in the source layout "
                        f"but {spec.dtype}{list(spec.shape)} in the destination; cast or fix "
                        "the layouts"
                    )
                cands = sources.get(dp.name, [])
                start = d % len(cands) if cands else 0
                todo = [tuple((a, a + n) for a, n in zip(dp.full_start, dp.size, strict=True))]
                if dp.numel == 0:
                    todo = []
                for s, slocal, slt, sp in cands[start:] + cands[:start]:
                    if not todo:
                        break
                    sbox = tuple((a, a + n) for a, n in zip(sp.full_start, sp.size, strict=True))
                    left = []
                    for box in todo:
                        cut = tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(box, sbox))
                        if any(a >= b for a, b in cut):
                            left.append(box)
                            continue
                        ops.append(_op(dp, dlocal, dlt, d, sp, slocal, slt, s, cut))
                        left.extend(_subtract(box, cut))
                    todo = left
                if todo:
                    raise ValueError(
                        f"destination rank {d} needs {dp.name!r}{[list(b) for b in todo]} but no "
                        f"source rank of {src.kind} holds it; the source layout is incomplete"
                    )
    ops.sort(key=lambda o: (o.dst_rank, o.src_rank))
    return TransferPlan(src, dst, tuple(ops))


def _op(
    dp: Piece, dlocal: str, dlt: LocalTensor, d: int,
    sp: Piece, slocal: str, slt: LocalTensor, s: int,
    cut: tuple[tuple[int, int], ...],
) -> CopyOp:  # fmt: skip
    full = tuple(a for a, _ in cut)
    size = tuple(b - a for a, b in cut)

    def local(p: Piece) -> tuple[int, ...]:
        lead = len(p.local_start) - len(p.size)
        inner = tuple(ls + f - pf for ls, f, pf in zip(p.local_start[lead:], full, p.full_start))
        return p.local_start[:lead] + inner

    return CopyOp(
        dp.name, full, size,
        s, slocal, slt.shape, local(sp),
        d, dlocal, dlt.shape, local(dp),
        dlt.dtype.itemsize,
    )  # fmt: skip


_cache: OrderedDict[tuple[str, str], TransferPlan] = OrderedDict()
_lock = threading.Lock()


def plan_transfer(src: Layout, dst: Layout) -> TransferPlan:
    """The plan moving src's shards into dst's layout, cached by the layouts' fingerprints.

    Raises:
        ValueError: dst needs a parameter src lacks, shapes/dtypes differ, or no source rank
            holds part of what a destination rank needs.
    """
    key = (src.fingerprint, dst.fingerprint)
    with _lock:
        plan = _cache.get(key)
        if plan is not None:
            _cache.move_to_end(key)
            return plan
    plan = _plan(src, dst)
    with _lock:
        _cache[key] = plan
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return plan


def clear_plan_cache() -> None:
    """Forget every cached plan."""
    with _lock:
        _cache.clear()
