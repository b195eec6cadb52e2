"""Apply several consecutive deltas at once, writing only the last version.

A host that is a few versions behind needs ``v+1, ..., v+k``. Materializing each in turn writes
``k`` full checkpoints; here each tensor of the last version is carried through the chain in
memory (from the base, or from the delta that added it) and written once. Every step's result
checksum is checked, so the output is exactly what the sequential route gives.
"""

from __future__ import annotations

import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

import torch

from miles_transfer._bytes import byte_view
from miles_transfer.checkpoint import SAFETENSORS_DTYPES
from miles_transfer.delta.codec import Encoding, apply_chunk, checksum, checksum_bytes, int_view
from miles_transfer.delta.encode import Progress, _fresh_staging, _publish
from miles_transfer.delta.format import (
    CheckpointIndex,
    dtype_name,
    iter_chunks,
    load_manifest,
    read_blob,
)
from miles_transfer.delta.materialize import (
    DeltaBaseError,
    MaterializeReport,
    _close,
    _nbytes,
    _parse_header,
)

__all__ = ["materialize_chain"]


def _start(
    base: CheckpointIndex, name: str, ms: list[dict[str, Any]], deltas: list[Path]
) -> tuple[int, torch.Tensor]:
    """Where ``name``'s history begins: (first delta to apply, starting tensor)."""
    for k in range(len(ms) - 1, -1, -1):
        t = ms[k]["tensors"].get(name)
        if t is None:
            raise DeltaBaseError(f"{name} is missing from the version {deltas[k]} produces")
        if t["op"] == "new":
            return k, torch.zeros(t["shape"], dtype=SAFETENSORS_DTYPES[t["dtype"]])
    t0 = ms[0]["tensors"][name]
    e = base.tensors.get(name)
    if e is None or dtype_name(e.dtype) != t0["dtype"] or list(e.shape) != t0["shape"]:
        raise DeltaBaseError(
            f"{base.path} does not match the base of delta {deltas[0]} (tensor {name}); apply "
            f"the chain to the checkpoint it starts from (version "
            f"{ms[0]['base'].get('version')!r})"
        )
    return 0, base.read(name, writable=True)


def _carry(
    base: CheckpointIndex,
    name: str,
    ms: list[dict[str, Any]],
    deltas: list[Path],
    payloads: list[IO[bytes]],
) -> torch.Tensor:
    """One tensor of the last version, carried through the chain and checked at each change."""
    k0, cur = _start(base, name, ms, deltas)
    view = int_view(cur)
    for k in range(k0, len(ms)):
        t = ms[k]["tensors"][name]
        enc: Encoding = "overwrite" if t["op"] == "new" else ms[k]["encoding"]
        n = t["chunk_elems"]
        for i, layout, c, ref in iter_chunks(t):
            raw = read_blob(payloads[k], ref, f"chunk {i} of {name}")
            try:
                apply_chunk(view[i * n : (i + 1) * n], layout, c, raw, enc)
            except (ValueError, IndexError, RuntimeError) as e:
                raise ValueError(f"{deltas[k]}: chunk {i} of {name} is corrupted: {e}") from e
        checked = t["op"] != "keep" or k == len(ms) - 1
        if checked and checksum(cur) != t["checksum"]:
            raise DeltaBaseError(
                f"{name} does not match the result checksum of {deltas[k]}: the chain does "
                f"not start from {base.path}, or a delta is corrupted"
            )
    return cur


def materialize_chain(
    base_dir: str | Path,
    deltas: list[Path],
    out: str | Path,
    *,
    progress: Progress | None = None,
) -> MaterializeReport:
    """Write the checkpoint that ``deltas`` (in order) make from ``base_dir``, into ``out``.

    Raises:
        DeltaBaseError: ``base_dir`` is not the first delta's base, or the deltas do not chain.
        ValueError: a corrupted, truncated or malformed delta, or a bad ``out``.
    """
    if not deltas:
        raise ValueError("materialize_chain needs at least one delta")
    t0 = time.perf_counter()
    loaded = [load_manifest(d) for d in deltas]
    ms = [m for m, _ in loaded]
    last = ms[-1]
    staging = _fresh_staging(Path(out))
    changed = sorted({n for m in ms for n, t in m["tensors"].items() if t["op"] != "keep"})
    total = sum(_nbytes(t) for t in last["tensors"].values())
    done = 0
    try:
        with CheckpointIndex(base_dir) as base, ExitStack() as stack:
            payloads: list[IO[bytes]] = [stack.enter_context(p.open("rb")) for _, p in loaded]
            for f in last["files"]:
                head = read_blob(payloads[-1], f["header"], f"the header of {f['name']}")
                layout = _parse_header(head, f, last, deltas[-1])
                sink = (staging / f["name"]).open("wb")
                try:
                    sink.write(head)
                    for name in f["tensors"]:
                        cur = _carry(base, name, ms, deltas, payloads)
                        sink.seek(layout[name])
                        sink.write(byte_view(cur.reshape(-1)))
                        done += _nbytes(ms[-1]["tensors"][name])
                        if progress is not None:
                            progress("apply", done, total)
                finally:
                    _close(sink)
            for name, o in last["other_files"].items():
                data = None
                for k in range(len(ms) - 1, -1, -1):
                    ok = ms[k]["other_files"].get(name)
                    if ok is not None and "blob" in ok:
                        data = read_blob(payloads[k], ok["blob"], f"file {name}")
                        break
                if data is None:
                    if name not in base.other_files:
                        raise DeltaBaseError(f"{base.path}: {name} is missing (the chain keeps it)")
                    data = base.read_other(name)
                if checksum_bytes(data) != o["checksum"]:
                    raise DeltaBaseError(f"{base.path}: file {name} does not match the chain")
                (staging / name).write_bytes(data)
        _publish(staging, Path(out))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return MaterializeReport(
        path=Path(out),
        version=last["result"].get("version"),
        tensors=len(last["tensors"]),
        changed=tuple(changed),
        bytes=total,
        seconds=time.perf_counter() - t0,
    )
