"""A weight payload that cannot execute code: a safetensors file in shared memory.

``load_format="miles_safetensors"`` on ``POST /update_weights_from_tensor`` (miles-rollout's
engine server and :class:`~miles_transfer.push.WeightServer`; they advertise it in
``/get_server_info`` as ``weight_load_formats``, and :class:`~miles_transfer.HTTPReceiver` picks
it by itself). The sender writes the tensors as one safetensors file (an 8-byte little-endian
header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``, the raw bytes) into
``/dev/shm`` and sends only ``{"path": ...}``. The receiver checks the path (a file of this
format's name pattern directly in the shared-memory directory, not a link), reads the bytes,
and checks the header field by field before any tensor exists: dtypes from a fixed list, shapes
of non-negative integers, spans inside the file that hold exactly their tensor's bytes. Nothing
in the payload is code; a bad payload is a ``ValueError`` (HTTP 400) naming the field.

The sender owns the file: it deletes it when the request returns (the receiver reads it inside
the request; an open file survives the unlink). Same host only, like SGLang's CPU payloads, and
one copy more than SGLang's pickled shared-memory handles (those stay for the real SGLang, which
reads only its own pickled format: ``flattened_bucket`` in ``push/wire.py``).
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from miles_transfer._bytes import byte_view

__all__ = ["SAFE_FORMAT", "discard_safe", "read_safe", "write_safe"]

SAFE_FORMAT = "miles_safetensors"
_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
_NAME = re.compile(r"^miles-weights-[0-9a-f]{32}\.safetensors$")
_ALIGN = 16
_MAX_HEADER = 64 << 20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_CODES = {v: k for k, v in DTYPES.items()}


def _shm_dir() -> Path:
    if _DIR is None:
        raise ValueError(
            f"load_format {SAFE_FORMAT!r} needs /dev/shm (shared memory on the same host); "
            "this system has none"
        )
    return _DIR


def write_safe(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Write the tensors as a safetensors file in ``/dev/shm``; return the payload string.

    CUDA tensors are copied to the CPU (this format carries bytes, not device handles). The file
    is readable by this user only; delete it with :func:`discard_safe` once the request returned.

    Raises:
        ValueError: no tensors, a non-string or repeated name, a dtype the format lacks, or a
            non-dense tensor.
    """
    items = [(name, t.detach()) for name, t in named_tensors]
    if not items:
        raise ValueError("a weight payload needs at least one tensor")
    header: dict[str, Any] = {}
    pos = 0
    for name, t in items:
        if not isinstance(name, str) or name == "__metadata__" or name in header:
            raise ValueError(f"tensor names must be distinct strings, got {name!r}")
        if t.layout != torch.strided:
            raise ValueError(f"{name}: only dense tensors can be sent, got layout {t.layout}")
        if t.dtype not in _CODES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code; cast it first")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos = -(-(pos + nbytes) // _ALIGN) * _ALIGN
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % _ALIGN)  # the data starts aligned (safetensors pads too)
    path = _shm_dir() / f"miles-weights-{uuid.uuid4().hex}.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for (_, t), spec in zip(items, header.values()):
                start = spec["data_offsets"][0]
                if f.tell() != 8 + len(head) + start:
                    f.write(b"\0" * (8 + len(head) + start - f.tell()))
                data = t.contiguous().cpu()
                f.write(byte_view(data))  # no numpy: torch does not depend on it
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return json.dumps({"path": str(path)})


def discard_safe(payload: str) -> None:
    """Delete the file of a payload written by :func:`write_safe` (idempotent)."""
    path = json.loads(payload)["path"]
    Path(path).unlink(missing_ok=True)


def _path(payload: Any) -> Path:
    if isinstance(payload, bytes | bytearray):
        payload = payload.decode("utf-8", "replace")
    if not isinstance(payload, str):
        raise ValueError(f"a {SAFE_FORMAT} payload is a JSON string, got {type(payload).__name__}")
    try:
        obj = json.loads(payload)
    except ValueError as e:
        raise ValueError(f'a {SAFE_FORMAT} payload is JSON {{"path": ...}}: {e}') from None
    if not isinstance(obj, dict) or set(obj) != {"path"} or not isinstance(obj["path"], str):
        raise ValueError(f'a {SAFE_FORMAT} payload is exactly {{"path": "<file>"}}')
    path = Path(obj["path"])
    if path.parent != _shm_dir() or not _NAME.match(path.name):
        raise ValueError(
            f"payload path {obj['path']!r} is not a {SAFE_FORMAT} file: it must be "
            f"{_shm_dir()}/miles-weights-<32 hex>.safetensors (written by the sender on this host)"
        )
    return path


def read_safe(payload: Any, *, max_bytes: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Read and check a :func:`write_safe` payload; return its ``(name, tensor)`` pairs.

    The tensors own their memory (a private copy of the file); the file is left to the sender.

    Raises:
        ValueError: a bad path, a file that is missing, too large, a link or not regular, or a
            header that does not describe the file exactly (the message names the field).
    """
    path = _path(payload)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(
            f"cannot open the payload file {path} ({e.strerror}): the sender must be on this host "
            "and keep the file until the request returns"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not (st.st_mode & 0o170000 == 0o100000):
            raise ValueError(f"payload file {path} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise ValueError(f"payload file {path} is {st.st_size} bytes, over {max_bytes}")
        data = bytearray(st.st_size)
        if f.readinto(data) != st.st_size:
            raise ValueError(f"payload file {path} changed while it was read")
    return parse_safetensors(data, str(path))


def parse_safetensors(data: bytearray, where: str) -> list[tuple[str, torch.Tensor]]:
    """Check a safetensors image field by field and view its tensors (no copy).

    Raises:
        ValueError: the first field that does not fit, named with ``where``.
    """
    if len(data) < 8:
        raise ValueError(f"{where}: {len(data)} bytes, not a safetensors file")
    (n,) = struct.unpack_from("<Q", data)
    if n > min(_MAX_HEADER, len(data) - 8):
        raise ValueError(f"{where}: header length {n} does not fit the file ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as e:
        raise ValueError(f"{where}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the header is a JSON {type(header).__name__}, not an object")
    start = 8 + n
    size = len(data) - start
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        field = f"{where}: tensor {name!r}"
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{field} must be {{dtype, shape, data_offsets}}, got {spec!r:.80}")
        dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{field}: dtype {spec['dtype']!r} is not one of {sorted(DTYPES)}")
        shape, offsets = spec["shape"], spec["data_offsets"]
        if not isinstance(shape, list) or not all(_nonneg(d) for d in shape):
            raise ValueError(f"{field}: shape {shape!r} is not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_nonneg, offsets))):
            raise ValueError(f"{field}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not begin <= end <= size or end - begin != numel * dtype.itemsize:
            raise ValueError(
                f"{field}: data_offsets [{begin}, {end}] do not hold {numel} x {dtype} inside "
                f"the {size} data bytes"
            )
        part = flat[start + begin : start + end]
        if (start + begin) % dtype.itemsize:
            part = part.clone()  # unaligned (another writer): a copy views cleanly
        out.append((name, part.view(dtype).reshape(shape)))
    return out


def _nonneg(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
