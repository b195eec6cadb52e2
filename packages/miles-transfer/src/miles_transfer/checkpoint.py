"""Read and write the safetensors format with the stdlib and torch only (no ``safetensors`` wheel).

Layout: an 8-byte little-endian unsigned header length ``N``; ``N`` bytes of UTF-8 JSON mapping
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
first byte after the header), plus an optional ``"__metadata__"`` of str to str; then the raw
little-endian, row-major tensor bytes.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from miles_transfer._bytes import byte_view

__all__ = ["SAFETENSORS_DTYPES", "iter_safetensors", "list_safetensors_files", "save_safetensors"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu"):  # torch >= 2.7 (MX block scales)
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def _header(path: Path) -> tuple[dict[str, Any], int, int]:
    """Return ``(entries, data_start, data_len)`` of one file, validated."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, entry in header.items():
        if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= set(entry)):
            raise ValueError(f"{path}: entry {name!r} lacks dtype/shape/data_offsets")
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{path}: {name} has dtype {entry['dtype']!r}, which this reader does not "
                f"support (supported: {', '.join(SAFETENSORS_DTYPES)})"
            )
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        ):
            raise ValueError(f"{path}: {name} has a malformed shape or data_offsets")
        begin, end = offsets
        numel = math.prod(shape)
        want = numel * SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        if not 0 <= begin <= end <= data_len or end - begin != want:
            raise ValueError(
                f"{path}: {name} spans bytes [{begin}, {end}) of {data_len}, expected {want} bytes"
            )
    return header, 8 + n, data_len


def list_safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a directory (sorted), or the file itself.

    Raises:
        ValueError: the path does not exist or holds no safetensors file.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ValueError(f"{p}: no such file or directory")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{p}: no *.safetensors files in this directory")
    return files


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a safetensors file or an HF checkpoint directory.

    Tensors are read one at a time into fresh CPU memory (never memory-mapped), in the order of
    the files (sorted) and, within a file, of their data offsets.

    Args:
        path: a ``.safetensors`` file, or a directory of them (sharded HF checkpoints).

    Raises:
        ValueError: missing path, malformed file, unsupported dtype, or a name found twice.
    """
    if sys.byteorder != "little":
        raise ValueError("reading safetensors needs a little-endian machine")
    seen: dict[str, Path] = {}
    for file in list_safetensors_files(path):
        header, data_start, _ = _header(file)
        with file.open("rb") as f:
            for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if name in seen:
                    raise ValueError(f"{name} appears in both {seen[name]} and {file}")
                seen[name] = file
                begin, end = e["data_offsets"]
                dtype = SAFETENSORS_DTYPES[e["dtype"]]
                shape = [int(d) for d in e["shape"]]
                if end == begin:
                    yield name, torch.empty(shape, dtype=dtype)
                    continue
                f.seek(data_start + begin)
                buf = bytearray(f.read(end - begin))
                t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
                yield name, t


def save_safetensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    path: str | Path,
    *,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write tensors to one safetensors file (readable by the ``safetensors`` library).

    Args:
        named_tensors: ``(name, tensor)`` pairs, unique names, supported dtypes, any device.
        path: the file to write.
        metadata: optional ``__metadata__`` (str to str), e.g. ``{"format": "pt"}``.

    Raises:
        ValueError: a duplicated name or an unsupported dtype.
    """
    items = [(n, t.detach().to("cpu").contiguous()) for n, t in named_tensors]
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, t in items:
        if name in header:
            raise ValueError(f"tensor name {name!r} appears twice")
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, as safetensors does
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            f.write(byte_view(t))
