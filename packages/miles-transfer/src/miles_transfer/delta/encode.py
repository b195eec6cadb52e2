"""Disk deltas between two HF safetensors checkpoints: encode.

``encode_delta(base, new, out)`` writes a delta directory (see ``delta.format``) holding only
the elements whose bits changed. ``materialize_delta`` (``delta.materialize``) writes the new
checkpoint from a base and a delta into a fresh directory; ``apply_delta`` (``delta.apply``)
does it in place.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from miles_transfer.delta.codec import (
    ENCODINGS,
    ChunkPatch,
    Encoding,
    checksum,
    checksum_bytes,
    compress,
    encode_chunk,
    int_view,
    payload_checksum,
)
from miles_transfer.delta.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PAYLOAD,
    CheckpointIndex,
    TensorEntry,
    dtype_name,
    fingerprint,
)
from miles_transfer.delta.native import DeltaBackend, StripeHash, resolve_backend
from miles_transfer.delta.pipeline import default_workers, ordered_map

__all__ = ["DEFAULT_CHUNK_ELEMS", "DeltaReport", "Progress", "encode_checkpoints", "encode_delta"]

DEFAULT_CHUNK_ELEMS = 1 << 22  # 4 Mi elements (8 MiB of bf16): bounded scratch memory
Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


@dataclass(frozen=True, slots=True)
class DeltaReport:
    """What ``encode_delta`` wrote.

    Attributes:
        path: the delta directory.
        encoding: ``"xor"`` or ``"overwrite"``.
        tensors: tensors in the new checkpoint.
        changed_tensors: tensors with at least one changed element (or new).
        elements: elements in the new checkpoint.
        changed_elements: elements whose bits differ from the base (all of a new tensor).
        full_bytes: bytes of the new checkpoint's tensors (what a full update would ship).
        payload_bytes: bytes of ``delta.bin`` (what this delta ships, plus a small manifest).
        manifest_bytes: bytes of ``delta.json``.
        seconds: wall time of the encode.
    """

    path: Path
    encoding: str
    tensors: int
    changed_tensors: int
    elements: int
    changed_elements: int
    full_bytes: int
    payload_bytes: int
    manifest_bytes: int
    seconds: float

    @property
    def changed_fraction(self) -> float:
        """Changed elements / all elements."""
        return self.changed_elements / max(self.elements, 1)

    @property
    def payload_fraction(self) -> float:
        """(payload + manifest) bytes / full checkpoint bytes."""
        return (self.payload_bytes + self.manifest_bytes) / max(self.full_bytes, 1)

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.encoding} delta: {self.changed_elements}/{self.elements} elements changed "
            f"({100 * self.changed_fraction:.3f}%) in {self.changed_tensors}/{self.tensors} "
            f"tensors; {self.payload_bytes + self.manifest_bytes} bytes vs {self.full_bytes} "
            f"full ({100 * self.payload_fraction:.3f}%); {self.seconds:.2f}s"
        )


def _fresh_staging(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new --out")
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path) -> None:
    """Move a finished staging directory into place (one rename)."""
    _fsync_dir(staging)
    if out.exists():
        out.rmdir()  # checked empty in _fresh_staging
    os.rename(staging, out)
    _fsync_dir(out.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _PayloadWriter:
    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.pos = f, 0

    def put(self, raw: bytes | memoryview, blob: bytes | None = None) -> list[Any]:
        blob = compress(raw) if blob is None else blob
        ref = [self.pos, len(blob), len(raw), payload_checksum(blob)]
        self.f.write(blob)
        self.pos += len(blob)
        return ref


def _cached_checksum(ckpt: CheckpointIndex, name: str, t: torch.Tensor | None) -> str:
    """A tensor's checksum, computed once per checkpoint object (a publisher's snapshot is
    hashed when it is new and reused when it becomes the next delta's base)."""
    if name not in ckpt.checksums:
        ckpt.checksums[name] = checksum(ckpt.read(name) if t is None else t)
    return ckpt.checksums[name]


def encode_checkpoints(
    base: CheckpointIndex,
    new: CheckpointIndex,
    out: str | Path,
    *,
    encoding: Encoding = "xor",
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    base_version: str | None = None,
    version: str | None = None,
    progress: Progress | None = None,
    backend: DeltaBackend = "auto",
) -> DeltaReport:
    """``encode_delta`` on opened checkpoints (directories or in-memory snapshots)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if not 0 < chunk_elems <= 1 << 30:
        raise ValueError(f"chunk_elems must be in [1, 2**30], got {chunk_elems}")
    t0 = time.perf_counter()
    out = Path(out)
    staging = _fresh_staging(out)
    total = sum(e.nbytes for e in new.tensors.values())
    done = elements = changed_elements = 0
    tensors: dict[str, dict[str, Any]] = {}
    files: list[dict[str, Any]] = []
    base_sums: dict[str, str] = {}

    def reads() -> Iterator[tuple[tuple[str, TensorEntry, torch.Tensor, torch.Tensor | None], int]]:
        for fname, entries in new.files.items():
            for e in entries:
                be = base.tensors.get(e.name)
                same = be is not None and be.dtype == e.dtype and be.shape == e.shape
                bt = base.read(e.name) if same else None
                yield (fname, e, new.read(e.name), bt), e.nbytes * (2 if same else 1)

    def compute(
        job: tuple[str, TensorEntry, torch.Tensor, torch.Tensor | None],
    ) -> tuple[str, TensorEntry, str, str | None, list[ChunkPatch]]:
        fname, e, nt, bt = job
        nv = int_view(nt)
        bv = torch.zeros_like(nv) if bt is None else int_view(bt)
        enc: Encoding = encoding if bt is not None else "overwrite"
        # The native scan hashes what it reads (new, and a base whose checksum is unknown).
        fused = resolve_backend(backend, nt) and StripeHash.usable(
            e.nbytes, chunk_elems * e.dtype.itemsize
        )
        hn = StripeHash(nt) if fused and e.name not in new.checksums else None
        hb = StripeHash(bt) if fused and bt is not None and e.name not in base.checksums else None
        patches = []
        for i, s in enumerate(range(0, nv.numel(), chunk_elems)):
            hashes = (hn, hb, s * e.dtype.itemsize) if fused else None
            patch = encode_chunk(
                i,
                bv[s : s + chunk_elems],
                nv[s : s + chunk_elems],
                enc,
                backend=backend,
                hashes=hashes,
            )
            if patch is not None:
                patches.append(patch)
        new_sum = new.checksums.get(e.name) or (hn.hexdigest() if hn else checksum(nt))
        base_sum = None
        if bt is not None:
            base_sum = base.checksums.get(e.name) or (hb.hexdigest() if hb else checksum(bt))
        return fname, e, new_sum, base_sum, patches

    try:
        with (staging / PAYLOAD).open("wb") as pf:
            w = _PayloadWriter(pf)
            for fname in new.files:
                head = new.headers[fname]
                files.append({"name": fname, "header": w.put(head), "tensors": []})
            file_specs = {f["name"]: f for f in files}
            for fname, e, new_sum, base_sum, patches in ordered_map(
                compute, reads(), workers=default_workers()
            ):
                file_specs[fname]["tensors"].append(e.name)
                new.checksums[e.name] = new_sum
                if base_sum is not None:
                    base.checksums[e.name] = base_sums[e.name] = base_sum
                spec: dict[str, Any] = {
                    "dtype": dtype_name(e.dtype),
                    "shape": list(e.shape),
                    "checksum": new_sum,
                    "base_checksum": base_sum,
                    "chunk_elems": chunk_elems,
                    "changed": sum(p.changed for p in patches),
                    "chunks": [],
                }
                for patch in patches:
                    ref = w.put(b"", patch.blob)
                    ref[2] = patch.raw_size
                    spec["chunks"].append([patch.index, patch.layout, patch.changed, ref])
                if base_sum is None:
                    spec["op"] = "new"
                else:
                    spec["op"] = "patch" if patches else "keep"
                tensors[e.name] = spec
                numel = e.nbytes // e.dtype.itemsize
                elements += numel
                changed_elements += spec["changed"]
                done += e.nbytes
                if progress is not None:
                    progress("encode", done, total)
            other: dict[str, dict[str, Any]] = {}
            for name in new.other_files:
                data = new.read_other(name)
                entry: dict[str, Any] = {"checksum": checksum_bytes(data)}
                if name not in base.other_files or base.read_other(name) != data:
                    entry["blob"] = w.put(data)
                other[name] = entry
            payload_size = w.pos
            pf.flush()
            os.fsync(pf.fileno())
        for name in base.tensors:
            if name not in base_sums:
                base_sums[name] = _cached_checksum(base, name, None)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "encoding": encoding,
            "compression": "zstd-1",
            "checksum": "xxh3-128",
            "base": {"version": base_version, "fingerprint": fingerprint(base_sums)},
            "result": {
                "version": version,
                "fingerprint": fingerprint({n: t["checksum"] for n, t in tensors.items()}),
            },
            "payload_size": payload_size,
            "files": files,
            "tensors": tensors,
            "other_files": other,
            "removed_tensors": sorted(set(base.tensors) - set(tensors)),
            "removed_files": sorted(
                (set(base.other_files) | set(base.files)) - set(other) - set(new.files)
            ),
        }
        raw = json.dumps(manifest, separators=(",", ":")).encode()
        with (staging / MANIFEST).open("wb") as mf:
            mf.write(raw)
            mf.flush()
            os.fsync(mf.fileno())
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return DeltaReport(
        path=out,
        encoding=encoding,
        tensors=len(tensors),
        changed_tensors=sum(t["op"] != "keep" for t in tensors.values()),
        elements=elements,
        changed_elements=changed_elements,
        full_bytes=total,
        payload_bytes=payload_size,
        manifest_bytes=len(raw),
        seconds=time.perf_counter() - t0,
    )


def encode_delta(
    base: str | Path,
    new: str | Path,
    out: str | Path,
    *,
    encoding: Encoding = "xor",
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    base_version: str | None = None,
    version: str | None = None,
    progress: Progress | None = None,
    backend: DeltaBackend = "auto",
) -> DeltaReport:
    """Write a delta directory that turns checkpoint ``base`` into checkpoint ``new``.

    Tensors are compared bit for bit in the dtype they are stored in (save the checkpoints in
    rollout precision, e.g. bf16). Tensors added, or whose dtype or shape changed, are stored
    whole; removed tensors and files are dropped on apply; the other files (``config.json``,
    tokenizer, ...) travel when they changed. The directory appears at ``out`` only once
    complete.

    Args:
        base: the HF safetensors directory the engine holds now.
        new: the HF safetensors directory it should hold.
        out: the delta directory to create (must not exist, or be empty).
        encoding: ``"xor"`` (smallest; applies exactly once, to exactly ``base``) or
            ``"overwrite"`` (positions and new values; idempotent).
        chunk_elems: elements per chunk (the unit of comparison and of scratch memory).
        base_version: a version label of ``base`` recorded in the manifest.
        version: a version label of ``new`` recorded in the manifest.
        progress: called as ``progress("encode", bytes_done, bytes_total)`` after each tensor.
        backend: ``"native"`` (the C++ compare-and-compact kernels), ``"torch"`` (the PyTorch
            reference) or ``"auto"`` (native when built). The delta's bytes are the same.

    Returns:
        Sizes and changed fractions.

    Raises:
        ValueError: a bad directory or argument.
        ImportError: zstd/xxhash missing (``pip install 'miles-transfer[delta]'``).
    """
    with CheckpointIndex(base) as b, CheckpointIndex(new) as n:
        return encode_checkpoints(
            b,
            n,
            out,
            encoding=encoding,
            chunk_elems=chunk_elems,
            base_version=base_version,
            version=version,
            progress=progress,
            backend=backend,
        )
