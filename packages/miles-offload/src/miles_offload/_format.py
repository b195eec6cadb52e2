"""The bucket file format (version 1) and the manifest.

A bucket file is ``header | payload``, both multiples of 4096 bytes so that O_DIRECT moves the
whole file in one transfer. The header starts with a fixed 24-byte record (little endian)::

    magic  b"MILESOFL"   8 bytes
    format version       uint32 (1)
    header bytes         uint32 (a multiple of 4096)
    JSON length          uint32
    JSON CRC-32C         uint32

followed by UTF-8 JSON: bucket index, generation, moment dtype, payload bytes, the payload's
CRC-32C, and per segment the parameter index, element range, offset, shape, dtype and the
parameter's step. The rest of the header is zero. The payload is the bucket's master, exp_avg
and exp_avg_sq sections (see `_layout`).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from miles_offload._layout import Bucket
from miles_offload._pager import ALIGN, crc32c

__all__ = ["FORMAT_VERSION", "MAGIC", "CorruptStateError", "decode_header", "encode_header"]

MAGIC = b"MILESOFL"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sIIII")
# Room per segment for values that change between writes (step, up to 2^63 generations...).
_SLACK_PER_SEGMENT = 48
_SLACK = 512


class CorruptStateError(RuntimeError):
    """Offloaded optimizer state failed an integrity check (truncated, corrupted or stale).

    The message names the file and the check, and ends with what to do: the state on disk
    cannot be trusted, so restore the optimizer from a checkpoint (``load_state_dict``) or start
    it fresh.
    """

    def __init__(self, message: str) -> None:
        # Idempotent, so that an unpickled error (args = the full message) is unchanged.
        super().__init__(message if message.endswith(REMEDY) else f"{message}. {REMEDY}")


REMEDY = (
    "The offloaded optimizer state cannot be trusted: restore it from a checkpoint with "
    "load_state_dict(), or start over with resume=False, overwrite=True"
)


def header_bytes(segment_desc: list[dict]) -> int:
    """Header size for a bucket with these segment descriptions (a multiple of ALIGN)."""
    n = (
        _FIXED.size
        + _SLACK
        + len(json.dumps(segment_desc))
        + _SLACK_PER_SEGMENT * len(segment_desc)
    )
    return -(-n // ALIGN) * ALIGN


def encode_header(
    buf: torch.Tensor,
    bucket: Bucket,
    desc: list[dict],
    steps: list[float],
    generation: int,
    payload_crc: int | None = None,
) -> None:
    """Write the header of ``bucket`` into ``buf[:header_bytes]``.

    ``payload_crc`` is the payload's CRC-32C when the caller has it (the pager computes it while
    writing); else it is computed here.
    """
    if payload_crc is None:
        payload_crc = crc32c(buf[bucket.header_bytes : bucket.nbytes])
    meta = {
        "bucket": bucket.index,
        "generation": generation,
        "moment_dtype": str(bucket.moment_dtype).removeprefix("torch."),
        "payload_bytes": bucket.payload_bytes,
        "payload_crc32c": payload_crc,
        "segments": desc,
        "steps": steps,
    }
    body = json.dumps(meta, separators=(",", ":")).encode()
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, bucket.header_bytes, len(body), 0)
    data = bytearray(bucket.header_bytes)
    need = len(fixed) + len(body)
    assert need <= bucket.header_bytes, (need, bucket.header_bytes)
    data[_FIXED.size : need] = body
    hdr = torch.frombuffer(data, dtype=torch.uint8)
    crc = crc32c(hdr[_FIXED.size : need])
    data[: _FIXED.size] = _FIXED.pack(MAGIC, FORMAT_VERSION, bucket.header_bytes, len(body), crc)
    buf[: bucket.header_bytes].copy_(hdr)


def decode_header(
    buf: torch.Tensor,
    bucket: Bucket,
    desc: list[dict],
    where: str,
    *,
    verify_payload: bool,
    payload_crc: int | None = None,
) -> dict[str, Any]:
    """Parse and check the header in ``buf``; return its JSON record.

    Checks the magic, version, sizes, the JSON checksum, that the recorded layout is
    ``desc`` with this bucket's moment dtype, and (with ``verify_payload``) the payload
    checksum: ``payload_crc`` when the caller has it (the pager computes it while reading),
    else computed here.

    Raises:
        CorruptStateError: any check failed; the message names ``where`` and the check.
    """
    head = bytes(buf[: _FIXED.size].tolist())
    magic, version, hbytes, jlen, jcrc = _FIXED.unpack(head)
    if magic != MAGIC:
        raise CorruptStateError(f"{where}: not a miles-offload bucket file (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        raise CorruptStateError(
            f"{where}: format version {version}, this miles-offload reads version "
            f"{FORMAT_VERSION}; load the state with the version that wrote it and re-save it "
            "through state_dict()"
        )
    if hbytes != bucket.header_bytes or _FIXED.size + jlen > hbytes:
        raise CorruptStateError(
            f"{where}: header size {hbytes} (JSON {jlen} bytes) does not match the expected "
            f"layout ({bucket.header_bytes} bytes)"
        )
    body = buf[_FIXED.size : _FIXED.size + jlen]
    got = crc32c(body)
    if got != jcrc:
        raise CorruptStateError(
            f"{where}: header checksum mismatch (stored {jcrc:#010x}, computed {got:#010x}): "
            "the file is corrupted"
        )
    meta: dict[str, Any] = json.loads(bytes(body.tolist()).decode())
    if meta["bucket"] != bucket.index or meta["segments"] != desc:
        raise CorruptStateError(
            f"{where}: the file describes another bucket layout than this optimizer's "
            "(different parameters or bucket size); resume through state_dict() / "
            "load_state_dict() instead"
        )
    moment_dtype = str(bucket.moment_dtype).removeprefix("torch.")
    if meta["moment_dtype"] != moment_dtype:
        raise CorruptStateError(
            f"{where}: moments stored as {meta['moment_dtype']}, this optimizer uses "
            f"{moment_dtype}; build it with moment_dtype={meta['moment_dtype']!r}, or move the "
            "state across through state_dict() / load_state_dict()"
        )
    if meta["payload_bytes"] != bucket.payload_bytes:
        raise CorruptStateError(f"{where}: payload size {meta['payload_bytes']} is unexpected")
    if verify_payload:
        if payload_crc is None:
            payload_crc = crc32c(buf[bucket.header_bytes : bucket.nbytes])
        if payload_crc != meta["payload_crc32c"]:
            raise CorruptStateError(
                f"{where}: payload checksum mismatch (stored {meta['payload_crc32c']:#010x}, "
                f"computed {payload_crc:#010x}): the optimizer state in this file is corrupted"
            )
    return meta
