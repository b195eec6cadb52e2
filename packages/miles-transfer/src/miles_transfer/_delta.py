"""Disk deltas between two HF safetensors checkpoints: encode, materialize, verify.

``encode_delta(base, new, out)`` writes a delta directory (see ``_delta_format``) holding only
the elements whose bits changed. ``materialize_delta(base, delta, out)`` writes the new
checkpoint into a fresh directory; ``apply_delta`` (``_delta_apply``) does it in place. Every
tensor of the result is checked against its xxh3-128 checksum before anything is published.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from miles_transfer._bytes import byte_view
from miles_transfer._delta_codec import (
    ENCODINGS,
    Encoding,
    apply_chunk,
    checksum,
    checksum_bytes,
    compress,
    encode_chunk,
    int_view,
    payload_checksum,
)
from miles_transfer._delta_format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PAYLOAD,
    CheckpointIndex,
    dtype_name,
    fingerprint,
    iter_chunks,
    load_manifest,
    read_blob,
)
from miles_transfer._safetensors import SAFETENSORS_DTYPES

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "DeltaBaseError",
    "DeltaReport",
    "MaterializeReport",
    "Progress",
    "encode_checkpoints",
    "encode_delta",
    "materialize_checkpoint",
    "materialize_delta",
]

DEFAULT_CHUNK_ELEMS = 1 << 22  # 4 Mi elements (8 MiB of bf16): bounded scratch memory
Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


class DeltaBaseError(ValueError):
    """The target is not the checkpoint a delta was made from (wrong version, or applied)."""


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


@dataclass(frozen=True, slots=True)
class MaterializeReport:
    """What applying a delta produced.

    Attributes:
        path: the directory written (``None`` for a dry run).
        version: the result's version string from the manifest (may be ``None``).
        tensors: tensors in the result.
        changed: names of the tensors the delta changed (or added), in file order.
        bytes: bytes of the result's tensors.
        seconds: wall time.
    """

    path: Path | None
    version: str | None
    tensors: int
    changed: tuple[str, ...]
    bytes: int
    seconds: float


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
    try:
        with (staging / PAYLOAD).open("wb") as pf:
            w = _PayloadWriter(pf)
            for fname, entries in new.files.items():
                head = new.headers[fname]
                files.append({"name": fname, "header": w.put(head), "tensors": []})
                for e in entries:
                    files[-1]["tensors"].append(e.name)
                    nt = new.read(e.name)
                    nv = int_view(nt)
                    be = base.tensors.get(e.name)
                    spec: dict[str, Any] = {
                        "dtype": dtype_name(e.dtype),
                        "shape": list(e.shape),
                        "checksum": _cached_checksum(new, e.name, nt),
                        "base_checksum": None,
                        "chunk_elems": chunk_elems,
                        "changed": 0,
                        "chunks": [],
                    }
                    if be is not None and be.dtype == e.dtype and be.shape == e.shape:
                        bt = base.read(e.name)
                        spec["base_checksum"] = base_sums[e.name] = _cached_checksum(
                            base, e.name, bt
                        )
                        bv, enc, op = int_view(bt), encoding, "patch"
                    else:
                        bv, enc, op = torch.zeros_like(nv), "overwrite", "new"
                    for i, s in enumerate(range(0, nv.numel(), chunk_elems)):
                        patch = encode_chunk(
                            i, bv[s : s + chunk_elems], nv[s : s + chunk_elems], enc
                        )
                        if patch is not None:
                            ref = w.put(b"", patch.blob)
                            ref[2] = patch.raw_size
                            spec["chunks"].append([i, patch.layout, patch.changed, ref])
                            spec["changed"] += patch.changed
                    if op == "patch" and not spec["chunks"]:
                        op = "keep"
                    spec["op"] = op
                    tensors[e.name] = spec
                    elements += nv.numel()
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
        )


def _check_base(base: CheckpointIndex, m: dict[str, Any], delta: Path) -> None:
    """Names, dtypes and shapes the delta needs from its base (cheap, before any work)."""
    bad = []
    for name, t in m["tensors"].items():
        if t["op"] == "new":
            continue
        e = base.tensors.get(name)
        if e is None:
            bad.append(f"{name} is missing")
        elif dtype_name(e.dtype) != t["dtype"] or list(e.shape) != t["shape"]:
            have = f"{dtype_name(e.dtype)}{list(e.shape)}"
            bad.append(f"{name} is {have}, not {t['dtype']}{t['shape']}")
    if bad:
        raise DeltaBaseError(
            f"{base.path} does not match the base of delta {delta} ({len(bad)} tensors: "
            f"{'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}); apply it to the checkpoint "
            f"it was encoded from (base version {m['base'].get('version')!r})"
        )


def _tensor_result(
    base: CheckpointIndex,
    name: str,
    t: dict[str, Any],
    encoding: Encoding,
    payload: IO[bytes],
    delta: Path,
    base_version: str | None,
) -> torch.Tensor:
    """Build one result tensor and check its final checksum."""
    if t["op"] == "new":
        out = torch.zeros(t["shape"], dtype=SAFETENSORS_DTYPES[t["dtype"]])
        enc: Encoding = "overwrite"
    else:
        out = base.read(name, writable=t["op"] == "patch")
        enc = encoding
        if t["op"] == "patch" and encoding == "xor":
            have = checksum(out)
            if have != t["base_checksum"]:
                state = (
                    "already holds this delta's result (an xor delta applies exactly once)"
                    if have == t["checksum"]
                    else "is neither the delta's base nor its result"
                )
                raise DeltaBaseError(
                    f"{base.path}: tensor {name} {state}; refusing to apply xor delta {delta} "
                    f"(made from base version {base_version!r})"
                )
    if t["op"] != "keep":
        view = int_view(out)
        n = t["chunk_elems"]
        for index, layout, changed, ref in iter_chunks(t):
            raw = read_blob(payload, ref, f"chunk {index} of {name}")
            try:
                apply_chunk(view[index * n : (index + 1) * n], layout, changed, raw, enc)
            except (ValueError, IndexError, RuntimeError) as e:
                raise ValueError(f"{delta}: chunk {index} of {name} is corrupted: {e}") from e
    if checksum(out) != t["checksum"]:
        what = "the patched tensor" if t["op"] != "keep" else "the unchanged tensor"
        raise DeltaBaseError(
            f"{base.path}: {what} {name} does not match the delta's result checksum; the "
            f"target is not the base this delta was encoded from (or the delta is corrupted)"
        )
    return out


def materialize_checkpoint(
    base: CheckpointIndex,
    delta: str | Path,
    out: str | Path | None,
    *,
    progress: Progress | None = None,
    keep_tensors: bool = False,
) -> tuple[MaterializeReport, dict[str, torch.Tensor]]:
    """Apply a delta to an opened base; write the result to ``out`` (None: dry run).

    Returns the report and, with ``keep_tensors``, the changed tensors by name.
    """
    t0 = time.perf_counter()
    delta = Path(delta)
    m, ppath = load_manifest(delta)
    _check_base(base, m, delta)
    staging = None if out is None else _fresh_staging(Path(out))
    kept: dict[str, torch.Tensor] = {}
    changed: list[str] = []
    total = sum(_nbytes(t) for t in m["tensors"].values())
    done = 0
    try:
        with ppath.open("rb") as payload:
            for f in m["files"]:
                head = read_blob(payload, f["header"], f"the header of {f['name']}")
                layout = _parse_header(head, f, m, delta)
                sink = None if staging is None else (staging / f["name"]).open("wb")
                try:
                    if sink is not None:
                        sink.write(head)
                    for name in f["tensors"]:
                        t = m["tensors"][name]
                        result = _tensor_result(
                            base, name, t, m["encoding"], payload, delta, m["base"].get("version")
                        )
                        if t["op"] != "keep":
                            changed.append(name)
                            if keep_tensors:
                                kept[name] = result
                        if sink is not None:
                            sink.seek(layout[name])
                            sink.write(byte_view(result.reshape(-1)))
                        done += _nbytes(t)
                        if progress is not None:
                            progress("apply", done, total)
                finally:
                    if sink is not None:
                        sink.flush()
                        os.fsync(sink.fileno())
                        sink.close()
            for name, o in m["other_files"].items():
                if "blob" in o:
                    data = read_blob(payload, o["blob"], f"file {name}")
                elif name in base.other_files:
                    data = base.read_other(name)
                else:
                    raise DeltaBaseError(f"{base.path}: {name} is missing (the delta keeps it)")
                if checksum_bytes(data) != o["checksum"]:
                    raise DeltaBaseError(
                        f"{base.path}: file {name} differs from the delta's base and result"
                    )
                if staging is not None:
                    with (staging / name).open("wb") as fo:
                        fo.write(data)
                        fo.flush()
                        os.fsync(fo.fileno())
        if staging is not None:
            assert out is not None
            _publish(staging, Path(out))
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    report = MaterializeReport(
        path=None if out is None else Path(out),
        version=m["result"].get("version"),
        tensors=len(m["tensors"]),
        changed=tuple(changed),
        bytes=total,
        seconds=time.perf_counter() - t0,
    )
    return report, kept


def _nbytes(t: dict[str, Any]) -> int:
    n = SAFETENSORS_DTYPES[t["dtype"]].itemsize
    for d in t["shape"]:
        n *= int(d)
    return n


def _parse_header(head: bytes, f: dict[str, Any], m: dict[str, Any], delta: Path) -> dict[str, int]:
    """``{tensor: absolute data offset}`` of a result file; checked against the manifest."""
    try:
        n = int.from_bytes(head[:8], "little")
        header = json.loads(head[8 : 8 + n])
        header.pop("__metadata__", None)
        offsets = {name: 8 + n + int(e["data_offsets"][0]) for name, e in header.items()}
        ok = len(head) == 8 + n and set(header) == set(f["tensors"])
        ok = ok and all(
            header[k]["dtype"] == m["tensors"][k]["dtype"]
            and header[k]["shape"] == m["tensors"][k]["shape"]
            for k in header
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{delta}: the stored header of {f['name']} is malformed: {e}") from e
    if not ok:
        raise ValueError(f"{delta}: the stored header of {f['name']} disagrees with the manifest")
    return offsets


def materialize_delta(
    base: str | Path,
    delta: str | Path,
    out: str | Path,
    *,
    progress: Progress | None = None,
) -> MaterializeReport:
    """Write the checkpoint that ``delta`` makes from ``base`` into a new directory ``out``.

    ``base`` is only read. ``out`` appears only once every tensor and file is written and has
    passed its checksum; on any error nothing is left behind.

    Raises:
        DeltaBaseError: ``base`` is not the checkpoint the delta was made from.
        ValueError: a corrupted, truncated or malformed delta, or a bad ``out``.
    """
    with CheckpointIndex(base) as b:
        report, _ = materialize_checkpoint(b, delta, out, progress=progress)
    return report
