"""How parameters map onto buckets, and where each piece lives inside a bucket buffer.

The parameters (local shards for DTensors), flattened in param-group order, are cut into buckets
of at most ``bucket_elems`` elements; a parameter larger than a bucket is split across several,
and an empty one (zero elements) gets a zero-length segment. A bucket buffer is ``[header |
master fp32 | exp_avg | exp_avg_sq]``: the header holds the file header (`_format`), every
section starts at a multiple of 4096 bytes, and every segment inside a section at a multiple of
16 elements (64-byte aligned for the vector units). The same layout serves the in-RAM buckets
(the header area then stays unused) and the files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from miles_offload._pager import ALIGN

__all__ = ["Bucket", "Segment", "layout_digest", "partition"]

_SEG_ALIGN = 16  # elements


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[start, start + numel)`` of flattened parameter ``param``, at ``offset``
    (elements) inside each section of its bucket."""

    param: int
    start: int
    numel: int
    offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket: its segments and the byte layout of its buffer (and file)."""

    index: int
    segments: tuple[Segment, ...]
    elems: int  # section length in elements (segments plus alignment padding)
    moment_dtype: torch.dtype
    header_bytes: int
    master_off: int
    avg_off: int
    sq_off: int
    nbytes: int  # header + payload, a multiple of ALIGN

    @property
    def payload_bytes(self) -> int:
        return self.nbytes - self.header_bytes

    def describe(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> list[dict]:
        """JSON-able description of the segments (the layout part of the file header)."""
        return [
            {
                "param": s.param,
                "start": s.start,
                "numel": s.numel,
                "offset": s.offset,
                "shape": list(shapes[s.param]),
                "dtype": str(dtypes[s.param]).removeprefix("torch."),
            }
            for s in self.segments
        ]

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master fp32, exp_avg, exp_avg_sq) flat views of a bucket buffer."""
        msize = torch.empty((), dtype=self.moment_dtype).element_size()
        n = self.elems
        master = buf[self.master_off : self.master_off + 4 * n].view(torch.float32)
        avg = buf[self.avg_off : self.avg_off + msize * n].view(self.moment_dtype)
        sq = buf[self.sq_off : self.sq_off + msize * n].view(self.moment_dtype)
        return master, avg, sq


def partition(
    numels: list[int],
    bucket_elems: int,
    moment_dtype: torch.dtype,
    header_bytes_for: object = None,
) -> list[Bucket]:
    """Cut parameters of ``numels`` elements into buckets of at most ``bucket_elems``.

    ``header_bytes_for(segments) -> int`` sizes each bucket's header area (0 if None).
    """
    assert bucket_elems >= _SEG_ALIGN
    pieces: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for p, n in enumerate(numels):
        if n == 0:
            # An empty parameter (an FSDP2 rank's empty shard) still takes steps: a zero-length
            # segment keeps it in a bucket, so its step is stored in that bucket's header.
            pieces[-1].append((p, 0, 0))
            continue
        start = 0
        while start < n:
            room = bucket_elems - used
            if room < _SEG_ALIGN:
                pieces.append([])
                used, room = 0, bucket_elems
            take = min(n - start, room)
            pieces[-1].append((p, start, take))
            used += _round_up(take, _SEG_ALIGN)
            start += take
    msize = torch.empty((), dtype=moment_dtype).element_size()
    buckets = []
    for i, group in enumerate(p for p in pieces if p):
        segs, off = [], 0
        for p, start, take in group:
            segs.append(Segment(p, start, take, off))
            off += _round_up(take, _SEG_ALIGN)
        elems = max(off, _SEG_ALIGN)
        header = header_bytes_for(segs) if callable(header_bytes_for) else 0
        master_off = header
        avg_off = master_off + _round_up(4 * elems, ALIGN)
        sq_off = avg_off + _round_up(msize * elems, ALIGN)
        nbytes = sq_off + _round_up(msize * elems, ALIGN)
        buckets.append(
            Bucket(i, tuple(segs), elems, moment_dtype, header, master_off, avg_off, sq_off, nbytes)
        )
    return buckets


def layout_digest(buckets: list[Bucket], shapes: list[tuple[int, ...]], dtypes: list) -> str:
    """A short digest of the whole layout, moment dtype included (stored in the manifest;
    resume checks it)."""
    desc = [[b.nbytes, str(b.moment_dtype), b.describe(shapes, dtypes)] for b in buckets]
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]
