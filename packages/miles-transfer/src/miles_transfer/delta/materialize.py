"""Materialize the checkpoint a disk delta makes from its base (into a new directory).

Every result tensor is rebuilt from the base and the delta's chunks and checked against its
xxh3-128 checksum before the directory is published (an xor delta applied to the wrong base,
or twice, fails that check; the base is then hashed to say which);
on any error nothing is left behind. ``materialize_checkpoint`` with ``out=None`` is a dry run
(``verify_delta``) and can hand back the changed tensors (engine-side apply).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from miles_transfer._bytes import byte_view
from miles_transfer.checkpoint import SAFETENSORS_DTYPES
from miles_transfer.delta.codec import (
    Encoding,
    apply_chunk,
    check_chunk,
    checksum,
    checksum_bytes,
    int_view,
)
from miles_transfer.delta.encode import Progress, _fresh_staging, _publish
from miles_transfer.delta.format import (
    CheckpointIndex,
    decode_frame,
    dtype_name,
    iter_chunks,
    load_manifest,
    read_blob,
    read_frame,
)
from miles_transfer.delta.native import (
    DeltaBackend,
    StripeHash,
    native_apply_fused,
    resolve_backend,
)
from miles_transfer.delta.pipeline import default_workers, ordered_map

__all__ = [
    "DeltaBaseError",
    "MaterializeReport",
    "materialize_checkpoint",
    "materialize_delta",
]


class DeltaBaseError(ValueError):
    """The target is not the checkpoint a delta was made from (wrong version, or applied)."""


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


# (file, tensor name, manifest entry, base tensor or None for a new one, [(chunk, layout,
# changed, frame ref, compressed frame)])
_Frame = tuple[int, str, int, Any, bytes]
# (file, name, manifest entry, start tensor (None: a new tensor), whether start is the base's own
# memory (the result then goes to fresh memory), frames)
_Job = tuple[str, str, dict[str, Any], "torch.Tensor | None", bool, list[_Frame]]
_Result = tuple[str, str, torch.Tensor, bool]


def _tensor_result(
    job: _Job, encoding: Encoding, delta: Path, backend: DeltaBackend = "auto"
) -> _Result:
    """Build one result tensor from its base and frames (worker thread; no I/O).

    Returns ``(file, name, tensor, checksum_ok)``.
    """
    fname, name, t, start, shared, frames = job
    n = t["chunk_elems"]
    patch = start is not None and t["op"] == "patch"
    if start is not None and patch and resolve_backend(backend, start):
        w = start.element_size()
        if StripeHash.usable(start.numel() * w, n * w):
            return _fused_result(job, encoding, delta)
    if start is None:
        out = torch.zeros(t["shape"], dtype=SAFETENSORS_DTYPES[t["dtype"]])
        enc: Encoding = "overwrite"
    else:
        out, enc = (start.clone() if shared and patch else start), encoding
    view = int_view(out)
    for index, layout, changed, ref, blob in frames:
        what = f"chunk {index} of {name}"
        raw = decode_frame(blob, ref, what)
        try:
            apply_chunk(
                view[index * n : (index + 1) * n], layout, changed, raw, enc, backend=backend
            )
        except (ValueError, IndexError, RuntimeError) as e:
            raise ValueError(f"{delta}: {what} is corrupted: {e}") from e
    return fname, name, out, checksum(out) == t["checksum"]


def _fused_result(job: _Job, encoding: Encoding, delta: Path) -> _Result:
    """``_tensor_result`` in one native pass per chunk: copy (from a shared base), patch and
    hash while the bytes are in cache, instead of a copy, a patch and a hash pass."""
    fname, name, t, start, shared, frames = job
    assert start is not None
    out = torch.empty_like(start) if shared else start
    src, dst = int_view(start), int_view(out)
    n, w, numel = t["chunk_elems"], start.element_size(), start.numel()
    h = StripeHash(out)
    by_index = {f[0]: f for f in frames}
    count = -(-numel // n)
    if len(by_index) != len(frames) or not all(0 <= i < count for i in by_index):
        raise ValueError(f"{delta}: the chunk list of {name} is corrupted (bad chunk indices)")
    for i in range(count):
        piece = slice(i * n, min(numel, (i + 1) * n))
        frame = by_index.get(i)
        if frame is None:
            native_apply_fused(dst[piece], src[piece], None, 0, b"", False, (h, i * n * w))
            continue
        _, layout, changed, ref, blob = frame
        what = f"chunk {i} of {name}"
        raw = decode_frame(blob, ref, what)
        try:
            check_chunk(layout, changed, len(raw), piece.stop - piece.start, w)
            native_apply_fused(
                dst[piece], src[piece], layout, changed, raw, encoding == "xor", (h, i * n * w)
            )
        except ValueError as e:
            raise ValueError(f"{delta}: {what} is corrupted: {e}") from e
    return fname, name, out, h.hexdigest() == t["checksum"]


def _mismatch(
    base: CheckpointIndex,
    name: str,
    t: dict[str, Any],
    encoding: str,
    delta: Path,
    m: dict[str, Any],
) -> DeltaBaseError:
    """The error for a result tensor whose checksum differs (the base is hashed to say why)."""
    if t["op"] == "patch" and encoding == "xor":
        have = checksum(base.read(name))
        if have != t["base_checksum"]:
            state = (
                "already holds this delta's result (an xor delta applies exactly once)"
                if have == t["checksum"]
                else "is neither the delta's base nor its result"
            )
            return DeltaBaseError(
                f"{base.path}: tensor {name} {state}; refusing to apply xor delta {delta} "
                f"(made from base version {m['base'].get('version')!r})"
            )
    what = "the patched tensor" if t["op"] != "keep" else "the unchanged tensor"
    return DeltaBaseError(
        f"{base.path}: {what} {name} does not match the delta's result checksum; the "
        f"target is not the base this delta was encoded from (or the delta is corrupted)"
    )


def materialize_checkpoint(
    base: CheckpointIndex,
    delta: str | Path,
    out: str | Path | None,
    *,
    progress: Progress | None = None,
    keep_tensors: bool = False,
    backend: DeltaBackend = "auto",
) -> tuple[MaterializeReport, dict[str, torch.Tensor]]:
    """Apply a delta to an opened base; write the result to ``out`` (None: dry run).

    Returns the report and, with ``keep_tensors``, the changed tensors by name. ``backend``
    picks the chunk kernels (``"auto"``, ``"native"``, ``"torch"``; same result).
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

    def reads(payload: IO[bytes]) -> Iterator[tuple[_Job, int]]:
        for f in m["files"]:
            for name in f["tensors"]:
                t = m["tensors"][name]
                # A base that hands out its own memory is read without a copy; the result then
                # goes to fresh memory (_tensor_result), else it is patched in place.
                shared = base.shares_memory
                start = None if t["op"] == "new" else base.read(name, writable=not shared)
                frames = [
                    (i, layout, k, ref, read_frame(payload, ref, f"chunk {i} of {name}"))
                    for i, layout, k, ref in iter_chunks(t)
                ]
                yield (f["name"], name, t, start, shared, frames), _nbytes(t)

    def compute(job: _Job) -> _Result:
        return _tensor_result(job, m["encoding"], delta, backend)

    try:
        with ppath.open("rb") as payload:
            layouts: dict[str, dict[str, int]] = {}
            for f in m["files"]:
                head = read_blob(payload, f["header"], f"the header of {f['name']}")
                layouts[f["name"]] = _parse_header(head, f, m, delta)
                if staging is not None:
                    (staging / f["name"]).write_bytes(head)
            sink: IO[bytes] | None = None
            sink_name = None
            try:
                for fname, name, result, ok in ordered_map(
                    compute, reads(payload), workers=default_workers()
                ):
                    t = m["tensors"][name]
                    if not ok:
                        raise _mismatch(base, name, t, m["encoding"], delta, m)
                    if t["op"] != "keep":
                        changed.append(name)
                        if keep_tensors:
                            kept[name] = result
                    if staging is not None:
                        if fname != sink_name:
                            _close(sink)
                            sink, sink_name = (staging / fname).open("r+b"), fname
                        assert sink is not None
                        sink.seek(layouts[fname][name])
                        sink.write(byte_view(result.reshape(-1)))
                    done += _nbytes(t)
                    if progress is not None:
                        progress("apply", done, total)
            finally:
                _close(sink)
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


def _close(sink: IO[bytes] | None) -> None:
    if sink is not None:
        sink.flush()
        os.fsync(sink.fileno())
        sink.close()


def _nbytes(t: dict[str, Any]) -> int:
    return SAFETENSORS_DTYPES[t["dtype"]].itemsize * math.prod(int(d) for d in t["shape"])


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
    backend: DeltaBackend = "auto",
) -> MaterializeReport:
    """Write the checkpoint that ``delta`` makes from ``base`` into a new directory ``out``.

    ``base`` is only read. ``out`` appears only once every tensor and file is written and has
    passed its checksum; on any error nothing is left behind. ``backend`` picks the chunk
    kernels (``"auto"``: native when built; ``"native"``; ``"torch"``); the result is the same.

    Raises:
        DeltaBaseError: ``base`` is not the checkpoint the delta was made from.
        ValueError: a corrupted, truncated or malformed delta, or a bad ``out``.
    """
    with CheckpointIndex(base) as b:
        report, _ = materialize_checkpoint(b, delta, out, progress=progress, backend=backend)
    return report
