"""On-disk layout of a disk delta, and random access to the tensors of an HF safetensors dir.

A delta directory holds two files:

- ``delta.json``, the manifest: format, encoding, base and result fingerprints, for every
  tensor of the result its dtype, shape, xxh3-128 checksum (of the final state, and of the base
  when there was one), and its changed chunks; for every result ``*.safetensors`` file its
  header; the other files of the checkpoint (``config.json``, tokenizer files, ...).
- ``delta.bin``, the payload: zstd frames back to back. The manifest addresses each one as
  ``[offset, size, raw_size, xxh3_64]``, so a truncated or corrupted payload is caught before
  anything is decompressed.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from miles_transfer._bytes import byte_view
from miles_transfer.checkpoint import SAFETENSORS_DTYPES, _header
from miles_transfer.delta.codec import (
    ENCODINGS,
    decompress,
    payload_checksum,
    writable_view,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PAYLOAD",
    "CheckpointIndex",
    "MemoryCheckpoint",
    "TensorEntry",
    "decode_frame",
    "fingerprint",
    "load_manifest",
    "read_blob",
    "read_frame",
]

FORMAT = "miles-transfer-delta"
FORMAT_VERSION = 1
MANIFEST = "delta.json"
PAYLOAD = "delta.bin"
_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a dtype (``BF16``)."""
    return _NAMES[dtype]


def fingerprint(checksums: dict[str, str]) -> str:
    """One xxh3-64 over the sorted ``name=checksum`` lines: equal iff every tensor is equal."""
    lines = "".join(f"{n}={c}\n" for n, c in sorted(checksums.items()))
    return payload_checksum(lines.encode())


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives in a checkpoint directory."""

    name: str
    path: Path
    offset: int  # absolute byte offset of its data in the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


class CheckpointIndex:
    """The tensors and other files of an HF checkpoint directory, read on demand.

    Args:
        path: a directory holding ``*.safetensors`` files (``config.json`` etc. optional).

    Raises:
        ValueError: not a directory, no safetensors file, a malformed file, or a duplicated name.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"{self.path}: not a directory (expected an HF checkpoint dir)")
        self.files: dict[str, list[TensorEntry]] = {}  # file name -> entries in data order
        self.headers: dict[str, bytes] = {}
        self.tensors: dict[str, TensorEntry] = {}
        self.other_files: list[str] = []
        for p in sorted(self.path.iterdir()):
            if p.name.startswith(".") or not p.is_file():
                continue  # our staging/backup dirs, and sub-directories, are not checkpoint files
            if p.suffix != ".safetensors":
                self.other_files.append(p.name)
                continue
            header, data_start, _ = _header(p)
            with p.open("rb") as f:
                self.headers[p.name] = f.read(data_start)
            entries = []
            for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if name in self.tensors:
                    raise ValueError(f"{name} appears in both {self.tensors[name].path} and {p}")
                entry = TensorEntry(
                    name,
                    p,
                    data_start + e["data_offsets"][0],
                    SAFETENSORS_DTYPES[e["dtype"]],
                    tuple(int(d) for d in e["shape"]),
                )
                self.tensors[name] = entry
                entries.append(entry)
            self.files[p.name] = entries
        if not self.files:
            raise ValueError(f"{self.path}: no *.safetensors files in this directory")
        self._open: dict[Path, io.BufferedReader] = {}
        self.checksums: dict[str, str] = {}  # filled by whoever hashes a tensor

    # Whether read(name) without writable returns memory this object keeps (so a caller that
    # modifies a tensor must ask for a copy); here every read is a fresh buffer.
    shares_memory = False

    def read(self, name: str, *, writable: bool = False) -> torch.Tensor:
        """Read one tensor into fresh CPU memory (always writable here)."""
        e = self.tensors[name]
        t = torch.empty(e.shape, dtype=e.dtype)
        f = self._open.get(e.path)
        if f is None:
            f = self._open[e.path] = e.path.open("rb")
        f.seek(e.offset)
        got = f.readinto(writable_view(t))
        if got != e.nbytes:
            raise ValueError(f"{e.path}: {name} is truncated ({got} of {e.nbytes} bytes)")
        return t

    def read_other(self, name: str) -> bytes:
        """The bytes of a non-safetensors file (``config.json``, ...)."""
        return (self.path / name).read_bytes()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryCheckpoint(CheckpointIndex):
    """An in-memory checkpoint laid out as one ``model.safetensors`` file (plus other files).

    The layout (header bytes, data offsets) is exactly what ``save_safetensors`` writes for the
    same tensors in the same order, so a delta against it materializes into that file.

    Args:
        named_tensors: ``(name, tensor)`` pairs; kept by reference (made contiguous on CPU).
        other_files: ``{file name: bytes}`` such as ``config.json``.
    """

    def __init__(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        other_files: dict[str, bytes] | None = None,
        *,
        file_name: str = "model.safetensors",
    ) -> None:
        self.path = Path(".")
        self._data: dict[str, torch.Tensor] = {}
        self._other = dict(other_files or {})
        self.other_files = sorted(self._other)
        header: dict[str, Any] = {}
        pos = 0
        for name, t in named_tensors:
            if name in self._data:
                raise ValueError(f"tensor name {name!r} appears twice")
            if t.dtype not in _NAMES:
                raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
            t = t.detach().to("cpu").contiguous()
            self._data[name] = t
            nbytes = t.numel() * t.element_size()
            header[name] = {
                "dtype": _NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [pos, pos + nbytes],
            }
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # as save_safetensors pads
        head = len(raw).to_bytes(8, "little") + raw
        self.headers = {file_name: head}
        self.tensors = {
            name: TensorEntry(
                name,
                self.path,
                len(head) + header[name]["data_offsets"][0],
                t.dtype,
                tuple(t.shape),
            )
            for name, t in self._data.items()
        }
        self.files = {file_name: list(self.tensors.values())}
        self._open = {}
        self.checksums = {}

    def write(self, directory: Path) -> None:
        """Write the checkpoint (``model.safetensors`` and the other files) into a directory."""
        for fname, entries in self.files.items():
            with (directory / fname).open("wb") as f:
                f.write(self.headers[fname])
                for e in entries:
                    f.write(byte_view(self._data[e.name].reshape(-1)))
                f.flush()
                os.fsync(f.fileno())
        for name, data in self._other.items():
            (directory / name).write_bytes(data)

    shares_memory = True

    def read(self, name: str, *, writable: bool = False) -> torch.Tensor:
        """The stored tensor itself, or a copy when the caller will modify it."""
        return self._data[name].clone() if writable else self._data[name]

    def read_other(self, name: str) -> bytes:
        return self._other[name]


def read_frame(payload: IO[bytes], ref: list[Any], what: str) -> bytes:
    """Read one ``[offset, size, raw_size, xxh3_64]`` frame and check its checksum.

    Raises:
        ValueError: the frame is truncated or its checksum differs.
    """
    offset, size, _, digest = ref
    payload.seek(offset)
    blob = payload.read(size)
    if len(blob) != size:
        raise ValueError(f"{PAYLOAD} is truncated: {what} needs bytes [{offset}, {offset + size})")
    if payload_checksum(blob) != digest:
        raise ValueError(f"{PAYLOAD} is corrupted: the checksum of {what} does not match")
    return blob


def decode_frame(blob: bytes, ref: list[Any], what: str) -> bytes:
    """Decompress a frame read by ``read_frame``.

    Raises:
        ValueError: it does not decompress to the recorded size.
    """
    try:
        return decompress(blob, ref[2])
    except ValueError as e:
        raise ValueError(f"{PAYLOAD}: {what}: {e}") from e


def read_blob(payload: IO[bytes], ref: list[Any], what: str) -> bytes:
    """``read_frame`` then ``decode_frame``."""
    return decode_frame(read_frame(payload, ref, what), ref, what)


def _require(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise ValueError(f"{path}: malformed delta manifest: {what}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_ref(mpath: Path, where: str, ref: Any, payload_size: int) -> None:
    """A payload frame reference ``[offset, size, raw_size, xxh3_64 hex]`` inside the payload."""
    _require(
        isinstance(ref, list)
        and len(ref) == 4
        and all(_int(v) for v in ref[:3])
        and isinstance(ref[3], str),
        mpath,
        f"{where} must be [offset, size, raw_size, checksum], got {json.dumps(ref)[:80]}",
    )
    _require(
        ref[0] + ref[1] <= payload_size,
        mpath,
        f"{where} = bytes [{ref[0]}, {ref[0] + ref[1]}) lie beyond the payload ({payload_size})",
    )


def _check_tensor(mpath: Path, name: str, t: Any, payload_size: int) -> None:
    """One ``tensors`` entry, field by field (a mistake names the tensor and the field)."""
    where = f"tensors[{name!r}]"
    _require(isinstance(t, dict), mpath, f"{where} must be an object")
    _require(t.get("dtype") in SAFETENSORS_DTYPES, mpath, f"{where}.dtype {t.get('dtype')!r}")
    shape = t.get("shape")
    _require(
        isinstance(shape, list) and all(_int(d) for d in shape),
        mpath,
        f"{where}.shape must be a list of integers >= 0, got {json.dumps(shape)[:80]}",
    )
    _require(isinstance(t.get("checksum"), str), mpath, f"{where}.checksum must be a string")
    _require(t.get("op") in ("keep", "patch", "new"), mpath, f"{where}.op {t.get('op')!r}")
    chunks = t.get("chunks")
    _require(isinstance(chunks, list), mpath, f"{where}.chunks must be a list")
    if not chunks:
        return
    n = t.get("chunk_elems")
    _require(_int(n) and n > 0, mpath, f"{where}.chunk_elems must be an integer > 0, got {n!r}")
    numel = math.prod(shape)
    count = -(-numel // n)
    for j, c in enumerate(chunks):
        cw = f"{where}.chunks[{j}]"
        _require(
            isinstance(c, list) and len(c) == 4,
            mpath,
            f"{cw} must be [index, layout, changed, ref], got {json.dumps(c)[:80]}",
        )
        index, layout, changed, ref = c
        _require(
            _int(index) and index < count,
            mpath,
            f"{cw}: chunk index must be an integer in [0, {count}), got {json.dumps(index)}",
        )
        _require(layout in ("sparse", "dense"), mpath, f"{cw}: layout {layout!r}")
        _require(_int(changed), mpath, f"{cw}: changed must be an integer >= 0, got {changed!r}")
        _check_ref(mpath, f"{cw} ref", ref, payload_size)


def load_manifest(delta_dir: str | Path) -> tuple[dict[str, Any], Path]:
    """Read and validate ``delta.json``; check the payload's size. Returns (manifest, payload).

    Every field the readers use is checked here (types, ranges, frames inside the payload), so a
    damaged manifest fails with the file and the field instead of deep inside a reader.

    Raises:
        ValueError: a missing, malformed or unsupported manifest, or a truncated payload.
    """
    d = Path(delta_dir)
    mpath, ppath = d / MANIFEST, d / PAYLOAD
    if not mpath.is_file():
        raise ValueError(
            f"{d}: no {MANIFEST}; not a delta directory (make one with miles-transfer delta encode)"
        )
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{mpath}: not valid JSON ({e}); the delta is corrupted") from e
    _require(isinstance(m, dict) and m.get("format") == FORMAT, mpath, f"format is not {FORMAT}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{mpath}: format_version {m.get('format_version')!r}; this miles-transfer reads "
            f"version {FORMAT_VERSION} (upgrade miles-transfer, or re-encode the delta)"
        )
    _require(m.get("encoding") in ENCODINGS, mpath, f"encoding not in {ENCODINGS}")
    for key in ("tensors", "files", "other_files", "base", "result", "payload_size"):
        _require(key in m, mpath, f"missing {key!r}")
    _require(isinstance(m["tensors"], dict) and isinstance(m["files"], list), mpath, "tables")
    size_ok = _int(m["payload_size"])
    _require(size_ok, mpath, f"payload_size must be an integer >= 0, got {m['payload_size']!r}")
    for name, t in m["tensors"].items():
        _check_tensor(mpath, name, t, m["payload_size"])
    for i, f in enumerate(m["files"]):
        where = f"files[{i}]"
        _require(isinstance(f, dict), mpath, f"{where} must be an object")
        _require(isinstance(f.get("name"), str), mpath, f"{where}.name must be a string")
        _check_ref(mpath, f"{where}.header", f.get("header"), m["payload_size"])
        tensors = f.get("tensors")
        _require(
            isinstance(tensors, list) and all(n in m["tensors"] for n in tensors),
            mpath,
            f"{where}.tensors must list tensors of the manifest",
        )
    _require(isinstance(m["other_files"], dict), mpath, "other_files must be an object")
    for name, entry in m["other_files"].items():
        where = f"other_files[{name!r}]"
        _require(isinstance(entry, dict), mpath, f"{where} must be an object")
        _require(isinstance(entry.get("checksum"), str), mpath, f"{where}.checksum: a string")
        if "blob" in entry:
            _check_ref(mpath, f"{where}.blob", entry["blob"], m["payload_size"])
    if not ppath.is_file():
        raise ValueError(f"{d}: {PAYLOAD} is missing; the delta is incomplete")
    size = os.path.getsize(ppath)
    if size != m["payload_size"]:
        raise ValueError(
            f"{ppath}: {size} bytes, the manifest says {m['payload_size']}: the payload is "
            f"{'truncated' if size < m['payload_size'] else 'corrupted'}"
        )
    return m, ppath


def iter_chunks(spec: dict[str, Any]) -> Iterator[tuple[int, str, int, list[Any]]]:
    """``(index, layout, changed, blob_ref)`` of a tensor entry's stored chunks."""
    for c in spec["chunks"]:
        index, layout, changed, ref = c
        yield int(index), str(layout), int(changed), list(ref)
