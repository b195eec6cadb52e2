"""Layouts: which box of which HF parameter sits where in each rank's local tensors.

One vocabulary covers both sides of a weight update. A trainer rank (an FSDP shard, a Megatron
TP/PP/EP rank) and a rollout rank (an engine TP/EP/DP rank) each hold *local tensors* under their
own names (Megatron's `linear_qkv`, SGLang's `qkv_proj`, `w13_weight`, or plain HF names). A
local tensor is a row-major array made of *pieces*: a piece says that the box
`[full_start, full_start + size)` of the HF parameter `name` is stored at the box starting at
`local_start` of the local tensor. Fused tensors (QKV, gate_up, stacked experts) are several
pieces; padding (vocabulary rounding) is local space no piece covers.

A local tensor may have more dimensions than the HF tensor (a stack of experts): the HF box then
maps onto the trailing dimensions and the leading local dimensions have extent 1.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "Layout",
    "LocalTensor",
    "ParamSpec",
    "Piece",
    "RankLayout",
    "materialize",
]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """Shape and dtype of one full (unsharded) HF parameter."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Piece:
    """The box `full_start + [0, size)` of HF parameter `name`, held at `local_start`.

    `size` has the HF tensor's rank; `local_start` has the local tensor's rank (>= the HF rank;
    extra leading local dimensions have extent 1).
    """

    name: str
    full_start: tuple[int, ...]
    size: tuple[int, ...]
    local_start: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def local_size(self) -> tuple[int, ...]:
        """The box extent in local coordinates (leading 1s for extra local dimensions)."""
        return (1,) * (len(self.local_start) - len(self.size)) + self.size


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A rank-local row-major tensor: its shape, dtype and the HF pieces it holds."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled tensor of this shape and dtype (a receive buffer)."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device)


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Everything one rank holds: local tensor name -> LocalTensor (in a fixed order)."""

    tensors: tuple[tuple[str, LocalTensor], ...]

    def as_dict(self) -> dict[str, LocalTensor]:
        return dict(self.tensors)

    def needed_bytes(self) -> int:
        """Bytes of HF parameters this rank holds (padding excluded)."""
        return sum(p.numel * lt.dtype.itemsize for _, lt in self.tensors for p in lt.pieces)

    def allocate(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Zero-filled buffers for every local tensor of this rank."""
        return {name: lt.allocate(device) for name, lt in self.tensors}


@dataclass(frozen=True)
class Layout:
    """A parallel layout: the full HF parameters and what each rank holds.

    Attributes:
        kind: a short description ("fsdp(ws=2)", "sglang(tp=2,dp=1,ep=1)", ...).
        params: HF name -> ParamSpec of every parameter the layout covers.
        ranks: one RankLayout per rank, in rank order.
        fingerprint: a digest of all of the above; equal layouts have equal fingerprints (the
            planner's cache key).
    """

    kind: str
    params: tuple[tuple[str, ParamSpec], ...]
    ranks: tuple[RankLayout, ...]
    fingerprint: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        names = dict(self.params)
        for r, rank in enumerate(self.ranks):
            for local, lt in rank.tensors:
                for p in lt.pieces:
                    _check_piece(names, r, local, lt, p)
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.kind, self.params, self.ranks)).encode())
        object.__setattr__(self, "fingerprint", h.hexdigest())

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def param_specs(self) -> dict[str, ParamSpec]:
        return dict(self.params)

    def rank(self, r: int) -> RankLayout:
        if not 0 <= r < len(self.ranks):
            raise ValueError(
                f"rank {r} is outside this {self.kind} layout of {len(self.ranks)} ranks"
            )
        return self.ranks[r]


def _check_piece(
    params: Mapping[str, ParamSpec], r: int, local: str, lt: LocalTensor, p: Piece
) -> None:
    where = f"rank {r}, local tensor {local!r}, piece of {p.name!r}"
    spec = params.get(p.name)
    if spec is None:
        raise ValueError(f"{where}: {p.name!r} is not a parameter of the layout; add its ParamSpec")
    if spec.dtype != lt.dtype:
        raise ValueError(
            f"{where}: local dtype {lt.dtype} differs from the parameter's {spec.dtype}"
        )
    if not len(p.full_start) == len(p.size) == len(spec.shape):
        raise ValueError(f"{where}: box rank differs from the parameter shape {spec.shape}")
    if len(p.local_start) != len(lt.shape) or len(lt.shape) < len(spec.shape):
        raise ValueError(f"{where}: local_start rank differs from the local shape {lt.shape}")
    for a, s, n in zip(p.full_start, p.size, spec.shape, strict=True):
        if a < 0 or s < 0 or a + s > n:
            raise ValueError(f"{where}: box {p.full_start}+{p.size} outside shape {spec.shape}")
    for a, s, n in zip(p.local_start, p.local_size(), lt.shape, strict=True):
        if a < 0 or a + s > n:
            raise ValueError(f"{where}: local box {p.local_start}+{p.size} outside {lt.shape}")


def make_layout(
    kind: str, params: Mapping[str, ParamSpec], ranks: Iterable[Mapping[str, LocalTensor]]
) -> Layout:
    """Build a Layout from plain mappings (names keep their insertion order)."""
    return Layout(
        kind=kind,
        params=tuple(params.items()),
        ranks=tuple(RankLayout(tuple(r.items())) for r in ranks),
    )


def local_box(t: torch.Tensor, start: Iterable[int], size: Iterable[int]) -> torch.Tensor:
    """The view of t's box `start + [0, size)` (no copy)."""
    out = t
    for d, (a, s) in enumerate(zip(start, size, strict=True)):
        out = out.narrow(d, a, s)
    return out


def iter_pieces(rank: RankLayout) -> Iterator[tuple[str, LocalTensor, Piece]]:
    for local, lt in rank.tensors:
        for p in lt.pieces:
            yield local, lt, p


def materialize(
    layout: Layout, rank: int, full: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The reference slicing: rank's local tensors cut from the full HF tensors.

    Space no piece covers (padding) is zero. This is the ground truth a transfer must reproduce
    bit for bit, and a convenient way to build a trainer rank's shards from a full state.

    Raises:
        ValueError: a full tensor is missing or has the wrong shape or dtype.
    """
    specs = layout.param_specs()
    out: dict[str, torch.Tensor] = {}
    for local, lt in layout.rank(rank).tensors:
        buf = lt.allocate()
        for p in lt.pieces:
            src = full.get(p.name)
            spec = specs[p.name]
            if src is None or tuple(src.shape) != spec.shape or src.dtype != spec.dtype:
                got = None if src is None else (tuple(src.shape), src.dtype)
                raise ValueError(
                    f"materialize: {p.name!r} must be a {spec.dtype} tensor of shape "
                    f"{spec.shape}, got {got}"
                )
            box = local_box(src, p.full_start, p.size)
            local_box(buf, p.local_start, p.local_size()).copy_(box.reshape(p.local_size()))
        out[local] = buf
    return out
