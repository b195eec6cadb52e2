"""SGLang's wire format for ``POST /update_weights_from_tensor``, with torch and the stdlib only.

What SGLang 0.5.x expects (checked against ``python/sglang/srt/utils/common.py``
``MultiprocessingSerializer``, ``python/sglang/srt/weight_sync/tensor_bucket.py``,
``python/sglang/srt/managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput`` and
``ModelRunner._update_weights_from_flattened_bucket``):

* The request body is JSON ``{"serialized_named_tensors": [payload, ...], "load_format": ...,
  "flush_cache": bool, "weight_version": str | None, ...}`` with one payload per TP rank
  (rank ``i`` reads entry ``i``).
* A payload is ``base64(pickle)`` written by ``multiprocessing.reduction.ForkingPickler``, so
  torch's tensor reducers apply: tensor *data* never travels in the pickle, only a handle to
  shared memory (CUDA IPC handles on GPU).
* With ``load_format=None`` (or ``"direct"`` / a custom loader) the pickled object is a list of
  ``(name, tensor)`` tuples.
* With ``load_format="flattened_bucket"`` it is ``{"flattened_tensor": flat, "metadata": [m, ...]}``
  where each ``m`` is a ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` dataclass
  with fields ``name, shape (torch.Size), dtype, start_idx, end_idx, numel``; the receiver takes
  ``flat[start_idx:end_idx]``, reinterprets it as ``dtype`` and reshapes. Older 0.5.x releases
  flatten in the tensors' own dtype (one dtype per bucket, element indices); newer ones
  (``FlattenedTensorBucket.supports_multi_dtypes = True``) flatten to ``uint8`` bytes and use
  ``.view(dtype)``. A single-dtype bucket flattened in its own dtype reads the same under both,
  so that is what we send; a mixed-dtype bucket goes as aligned ``uint8`` bytes (newer SGLang only).
* SGLang unpickles with an allowlist (``SafeUnpickler``, CVE-2025-10164) that admits ``torch.*``,
  ``copyreg.*`` and ``sglang.srt.weight_sync.tensor_bucket.*``; our payloads reference nothing else
  (the metadata class is written under SGLang's module path, though SGLang need not be installed).

CPU tensors and shared memory (the part SGLang leaves to torch). torch's default ``file_descriptor``
sharing passes file descriptors over a socket authenticated by the *sending process tree*, so it
cannot cross an HTTP request between unrelated processes. CPU tensors are therefore always shared
with torch's ``file_system`` strategy (without changing the process-wide setting): the pickle
carries the name of a file in ``/dev/shm`` plus the sender's ``torch_shm_manager`` socket. Both
processes must be on the same host. Lifetime rules:

* ``serialize_named_tensors`` copies the tensors into one fresh shared-memory file per payload (the
  caller's tensors are never moved into shared memory) and takes ``consumers`` in-flight references
  on it, one per process that will deserialise the payload (one per TP rank). The sender may drop
  everything as soon as the string exists; the file lives on the in-flight references.
* Each ``deserialize_named_tensors`` consumes one in-flight reference. The returned tensors map the
  file: copy them into your weights and drop them. When the last mapping closes, torch unlinks the
  file (nothing is left in ``/dev/shm``).
* A payload that will never be deserialised (the request failed before the server read it) still
  holds its references: call ``discard_serialized`` on it. Otherwise the file stays until the
  sender's ``torch_shm_manager`` exits (it removes its leftovers when its last client process ends).

Security: deserialising is unpickling. Our unpickler admits only the handful of torch rebuild
functions and classes the format needs, but even those let a crafted payload make this process open
arbitrary shared-memory files, IPC handles and local sockets. So this format is what the real SGLang
gets (it reads nothing else); Miles' own servers take ``load_format="miles_safetensors"``
(``push/safe_wire.py``: a safetensors file in shared memory, nothing executable) and refuse pickled
payloads from the network unless started with ``allow_pickle`` (``--allow-pickle-weights``).
"""

from __future__ import annotations

import base64
import binascii
import copyreg
import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as _reductions

from miles_transfer.push.safe_wire import SAFE_FORMAT, discard_safe, read_safe, write_safe

__all__ = ["deserialize_named_tensors", "discard_serialized", "serialize_named_tensors"]

FLATTENED_BUCKET = "flattened_bucket"
_SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
_SGLANG_METADATA_NAME = "FlattenedTensorMetadata"
# Byte alignment of each tensor inside a packed buffer, so that ``.view(dtype)`` is legal.
_ALIGN = 16
_PROTOCOL = 4


@dataclass
class FlattenedTensorMetadata:
    """Field-for-field twin of SGLang's ``FlattenedTensorMetadata`` (pickled under its name).

    ``start_idx``/``end_idx``/``numel`` count elements of the flattened tensor (bytes when it is
    ``uint8``). Deliberately a plain dataclass (no slots): SGLang's is, and pickle's BUILD of a
    ``__dict__`` state must work on both sides.
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """Reduce a CPU storage the way torch's ``file_system`` strategy does, whatever the global one.

    Emits the same ``rebuild_storage_filename`` call torch would, so any torch (and SGLang) reader
    accepts it. Takes one in-flight reference that the reader's rebuild consumes.
    """
    assert storage.device.type == "cpu", storage.device
    if storage.nbytes() == 0:
        return (_reductions.rebuild_storage_empty, (type(storage),))
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()
    _reductions.shared_cache[handle] = _reductions.StorageWeakRef(storage)
    return (_reductions.rebuild_storage_filename, (type(storage), manager, handle, size))


def _dispatch_table() -> dict[Any, Any]:
    table: dict[Any, Any] = dict(copyreg.dispatch_table)
    # torch.multiprocessing registered its tensor/storage reducers here at import time.
    table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    table[torch.UntypedStorage] = _reduce_cpu_storage
    return table


# typeshed leaves out the pure-Python pickler's internals (write, memoize, save_global).
_PurePickler: Any = pickle._Pickler


class _WirePickler(_PurePickler):
    """ForkingPickler's reducers, CPU storages by file name, metadata under SGLang's class path.

    The pure-Python pickler is used because only it lets us name a class that is not importable
    here (SGLang's). Payloads hold handles, not data, so its speed does not matter.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self.dispatch_table = _dispatch_table()

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:
            self.write(
                pickle.GLOBAL + f"{_SGLANG_METADATA_MODULE}\n{_SGLANG_METADATA_NAME}\n".encode()
            )
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _shared_cpu_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh CPU tensor allocated directly in a ``/dev/shm`` file (filled in place later).

    Allocating in shared memory, rather than sharing a finished tensor, saves a copy and the page
    faults of a second buffer (about 7x faster for a 256 MiB bucket here).
    """
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    storage = torch.UntypedStorage._new_using_filename_cpu(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


def _check_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    items = [(name, t.detach()) for name, t in named_tensors]
    if not items:
        raise ValueError("serialize_named_tensors needs at least one tensor")
    devices = {t.device for _, t in items}
    if len(devices) != 1:
        raise ValueError(
            f"all tensors of one payload must be on one device, got {sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"cannot share tensors on device {device}: only cpu and cuda are supported"
        )
    for name, t in items:
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, got {type(name).__name__}")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(
                f"{name}: only dense strided tensors can be sent, got layout {t.layout}"
            )
    return items


def _flatten(items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Pack into SGLang's flattened-bucket dict (own dtype if uniform, else aligned bytes)."""
    device = items[0][1].device
    dtypes = {t.dtype for _, t in items}
    metadata: list[FlattenedTensorMetadata] = []
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        offsets, pos = [], 0
        for _, t in items:
            offsets.append(pos)
            pos += t.numel()
        flat = (
            _shared_cpu_buffer(pos, dtype)
            if device.type == "cpu"
            else torch.empty(pos, dtype=dtype, device=device)
        )
        for (name, t), start in zip(items, offsets):
            end = start + t.numel()
            flat[start:end].copy_(t.reshape(-1))
            metadata.append(
                FlattenedTensorMetadata(name, t.shape, t.dtype, start, end, end - start)
            )
    else:
        flat, spans = _pack_bytes(items, device)
        for (name, t), (start, end) in zip(items, spans):
            metadata.append(
                FlattenedTensorMetadata(name, t.shape, t.dtype, start, end, end - start)
            )
    return {"flattened_tensor": flat, "metadata": metadata}


def _pack_bytes(
    items: list[tuple[str, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    spans, pos = [], 0
    for _, t in items:
        nbytes = t.numel() * t.element_size()
        spans.append((pos, pos + nbytes))
        pos = _align(pos + nbytes)
    flat = (
        _shared_cpu_buffer(pos, torch.uint8)
        if device.type == "cpu"
        else torch.empty(pos, dtype=torch.uint8, device=device)
    )
    for (_, t), (start, end) in zip(items, spans):
        if end > start:
            flat[start:end].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return flat, spans


def _as_list(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The plain list format; CPU tensors become views of one shared buffer (one file a payload)."""
    device = items[0][1].device
    if device.type != "cpu":
        # CUDA IPC shares the caching-allocator block as is; torch keeps it alive for consumers.
        return [(name, t.contiguous()) for name, t in items]
    flat, spans = _pack_bytes(items, device)
    return [
        (name, flat[start:end].view(t.dtype).view(t.shape))
        for (name, t), (start, end) in zip(items, spans)
    ]


def serialize_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    load_format: str | None = None,
    consumers: int = 1,
) -> str:
    """Serialise named tensors into one SGLang ``update_weights_from_tensor`` payload.

    The result is one entry of ``serialized_named_tensors`` (send the same string once per TP rank
    and pass ``consumers=tp_size``). Bits are preserved exactly; shapes and dtypes too. The
    caller's tensors are copied (CPU) or referenced (CUDA), never modified. See the module
    docstring for the shared-memory lifetime rules.

    Args:
        named_tensors: ``(name, tensor)`` pairs, all on one device (cpu or cuda), dense.
        load_format: ``"flattened_bucket"`` for SGLang's flattened-bucket layout;
            ``"miles_safetensors"`` for the safe format of Miles' servers (a safetensors file in
            ``/dev/shm``; the sender deletes it with ``discard_serialized`` once the request
            returned); anything else (``None``, ``"direct"``, a custom loader) gives the plain
            list of pairs.
        consumers: how many processes will deserialise this payload (one in-flight reference each).

    Returns:
        The base64 text of the pickle (the safe format: ``{"path": ...}``).

    Raises:
        ValueError: no tensors, mixed devices, an unsupported device/layout, or ``consumers < 1``.
    """
    if consumers < 1:
        raise ValueError(f"consumers must be >= 1, got {consumers}")
    if load_format == SAFE_FORMAT:
        return write_safe(named_tensors)
    items = _check_named_tensors(named_tensors)
    obj: Any = _flatten(items) if load_format == FLATTENED_BUCKET else _as_list(items)
    buf = io.BytesIO()
    _WirePickler(buf).dump(obj)
    if items[0][1].device.type == "cpu":
        for _ in range(consumers - 1):
            # Each further dump takes one more in-flight reference on every shared storage.
            _WirePickler(io.BytesIO()).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    red = "torch.multiprocessing.reductions"
    allowed: dict[tuple[str, str], Any] = {
        (red, name): getattr(_reductions, name)
        for name in (
            "rebuild_tensor",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
            "rebuild_cuda_tensor",
        )
    }
    for cls in (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.TypedStorage):
        allowed[(cls.__module__, cls.__name__)] = cls
    allowed[("torch", "Tensor")] = torch.Tensor
    allowed[("torch", "UntypedStorage")] = torch.UntypedStorage
    allowed[("torch", "TypedStorage")] = torch.TypedStorage
    allowed[("torch", "Size")] = torch.Size
    allowed[(_SGLANG_METADATA_MODULE, _SGLANG_METADATA_NAME)] = FlattenedTensorMetadata
    # Older SGLang kept the class in model_runner; senders may still name it there.
    allowed[("sglang.srt.model_executor.model_runner", _SGLANG_METADATA_NAME)] = (
        FlattenedTensorMetadata
    )
    allowed[(__name__, _SGLANG_METADATA_NAME)] = FlattenedTensorMetadata
    return allowed


_ALLOWED = _allowed_globals()


class _WireUnpickler(pickle.Unpickler):
    """Admits exactly the globals a weight payload needs (``_allowed_globals``) and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: not part of the weight payload format"
        )


def _payload_bytes(payload: str | bytes) -> bytes:
    """A payload's pickle bytes: base64 text (SGLang's JSON field) or the raw bytes."""
    if isinstance(payload, str):
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"payload is not valid base64: {e}") from e
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    raise ValueError(f"payload must be str (base64) or bytes, got {type(payload).__name__}")


def _decode(payload: str | bytes) -> Any:
    raw = _payload_bytes(payload)
    try:
        return _WireUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"payload is not a weight payload: {e}") from e


def _reconstruct(flat: torch.Tensor, meta: FlattenedTensorMetadata) -> torch.Tensor:
    if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
        raise ValueError(
            f"{meta.name}: span [{meta.start_idx}, {meta.end_idx}) lies outside the bucket "
            f"of {flat.numel()} elements"
        )
    part = flat[meta.start_idx : meta.end_idx]
    if part.dtype != meta.dtype:
        if flat.dtype != torch.uint8:
            raise ValueError(
                f"{meta.name}: a {flat.dtype} bucket cannot hold a {meta.dtype} tensor"
            )
        part = part.view(meta.dtype)
    if part.numel() != torch.Size(meta.shape).numel():
        raise ValueError(
            f"{meta.name}: {part.numel()} elements do not fill shape {tuple(meta.shape)}"
        )
    return part.view(meta.shape)


def deserialize_named_tensors(
    payload: str | bytes, *, load_format: str | None = None, allow_pickle: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Turn one ``serialized_named_tensors`` entry back into ``(name, tensor)`` pairs.

    ``load_format="miles_safetensors"`` reads the safe format (``push/safe_wire.py``). Every
    other format unpickles: unsafe on untrusted input (restricted to torch's rebuild functions,
    which still open shared memory and IPC handles named by the payload), so a server passes
    ``allow_pickle=False`` unless told otherwise. CPU payloads must come from the same host.

    The returned tensors map the sender's shared memory (no copy): copy them into your weights,
    then drop them so the shared file can be removed. Each call consumes one of the payload's
    in-flight references, so call it once per consumer the sender declared.

    Args:
        payload: the base64 text (or raw pickle bytes) of one entry.
        load_format: the request's ``load_format``; ``"flattened_bucket"`` expects the bucket dict.
        allow_pickle: accept the pickled formats (False: only ``miles_safetensors``).

    Returns:
        The pairs, in the sender's order.

    Raises:
        ValueError: the payload is malformed, of the other format, names a forbidden global, or
            is pickled while ``allow_pickle`` is False.
    """
    if load_format == SAFE_FORMAT:
        return read_safe(payload)
    if not allow_pickle:
        raise ValueError(
            f"load_format {load_format!r} payloads are pickles, which this server does not "
            f"accept: send load_format={SAFE_FORMAT!r} (miles_transfer.HTTPReceiver picks it by "
            "itself), or start the server with --allow-pickle-weights on a trusted network"
        )
    obj = _decode(payload)
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError("a flattened_bucket payload must be {'flattened_tensor', 'metadata'}")
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
            raise ValueError("flattened_tensor must be a 1-D tensor")
        if not isinstance(metadata, list) or not all(
            isinstance(m, FlattenedTensorMetadata) for m in metadata
        ):
            raise ValueError("metadata must be a list of FlattenedTensorMetadata")
        return [(m.name, _reconstruct(flat, m)) for m in metadata]
    if not isinstance(obj, list) or not all(
        isinstance(p, tuple)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise ValueError(
            "expected a list of (name, tensor) pairs; for a flattened bucket pass "
            "load_format='flattened_bucket'"
        )
    return list(obj)


def discard_serialized(
    payload: str | bytes, *, load_format: str | None = None, consumers: int = 1
) -> None:
    """Release the in-flight shared-memory references of a payload nobody will deserialise.

    Call it in the sending process when a request failed before the server read the payload
    (connection refused, request rejected). Calling it for a payload that *was* consumed can
    leave the file behind until the sender's ``torch_shm_manager`` exits, never worse.

    Args:
        payload: the string returned by ``serialize_named_tensors``.
        load_format: the format it was serialised with.
        consumers: the ``consumers`` it was serialised with (minus those known to have read it).

    A ``miles_safetensors`` payload's file is deleted whether or not it was read (the sender
    owns it; a reader that has it open keeps reading).
    """
    if load_format == SAFE_FORMAT:
        discard_safe(str(payload if isinstance(payload, str) else payload.decode()))
        return
    for _ in range(consumers):
        deserialize_named_tensors(payload, load_format=load_format)
