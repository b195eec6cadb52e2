"""CUDA IPC payloads for SGLang's ``update_weights_from_tensor``: an engine on the trainer's GPUs.

When the trainer and an SGLang engine share GPUs (colocated), a weight update sends no bytes:
each payload is SGLang's pickle of a CUDA tensor, i.e. torch's ``rebuild_cuda_tensor`` call with
a CUDA IPC handle of the allocation that holds it, and the engine's TP rank ``i`` maps the memory
of payload ``i`` (made by the trainer rank on the same GPU). What SGLang 0.5.x does with it
(``tp_worker.update_weights_from_tensor`` and ``utils/patch_torch.py``, read, not run here):

* Before unpickling it calls ``monkey_patch_torch_reductions()``, whose ``rebuild_cuda_tensor``
  accepts the device argument (index 6 of the reduce tuple) as an int or as the device's UUID
  string (``str(torch.cuda.get_device_properties(i).uuid)``) and maps a UUID to its own index.
  A UUID survives different ``CUDA_VISIBLE_DEVICES`` in trainer and engine, so it is what we
  send by default (``device_ref="uuid"``), as slime and Miles' SGLang senders do.
* torch writes the storage handle as ``[version byte][type byte][payload]``: type ``'c'`` is a
  ``cudaMalloc`` block followed by its 64-byte ``cudaIpcMemHandle_t``, ``'e'`` an expandable
  segment. An engine on an older torch refuses a newer version byte; torch 2.13 writes 3 with
  the same ``'c'`` payload as version 2 (read in NeMo-RL's compatibility shim), so
  ``handle_version=2`` lets a torch 2.13 trainer feed an engine on torch <= 2.12.

Nothing here initialises CUDA at import. Building a payload needs CUDA tensors (torch only);
``describe_cuda_ipc`` parses a payload without CUDA; the handle-level checks and reads with
``cuda-python`` live in ``push/cuda_runtime.py`` (``pip install 'miles-transfer[cuda]'``).
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.multiprocessing.reductions as _reductions

from miles_transfer.push.wire import (
    FLATTENED_BUCKET,
    FlattenedTensorMetadata,
    _as_list,
    _flatten,
    _payload_bytes,
    _reconstruct,
    _WirePickler,
    _WireUnpickler,
)

__all__ = [
    "CudaIPCPayload",
    "CudaIPCRef",
    "IPCSpan",
    "describe_cuda_ipc",
    "device_uuid",
    "open_cuda_ipc",
    "parse_torch_handle",
    "serialize_cuda_ipc",
]

_REDUCTIONS = "torch.multiprocessing.reductions"
# Index of the device argument of rebuild_cuda_tensor (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX).
_DEVICE_ARG = 6
_HANDLE_ARG = 7
_CUDA_IPC_HANDLE_BYTES = 64
_DEVICE_REFS = ("uuid", "index")
# Names a CUDA rebuild call travels under: torch's, or SGLang's patched one (payloads that
# SGLang's own MultiprocessingSerializer wrote in a process where the patch was applied).
_REBUILD_NAMES = {
    (_REDUCTIONS, "rebuild_cuda_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"),
}


def _torch_rebuild_cuda_tensor() -> Any:
    """torch's own rebuild function, also when SGLang has patched the module in this process."""
    return getattr(_reductions, "_rebuild_cuda_tensor_original", _reductions.rebuild_cuda_tensor)


def _torch_reduce_tensor() -> Any:
    return getattr(_reductions, "_reduce_tensor_original", _reductions.reduce_tensor)


def device_uuid(index: int) -> str:
    """The UUID string SGLang compares: ``str(torch.cuda.get_device_properties(index).uuid)``."""
    return str(torch.cuda.get_device_properties(index).uuid)


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchHandle:
    """torch's storage handle, split: ``version`` (None for a bare pre-versioning handle),
    ``kind`` (``"c"`` cudaMalloc block, ``"e"`` expandable segment) and, for ``"c"``, the
    64-byte ``cudaIpcMemHandle_t``."""

    version: int | None
    kind: str
    cuda_handle: bytes | None


def parse_torch_handle(handle: bytes) -> TorchHandle:
    """Split a ``rebuild_cuda_tensor`` storage handle (see the module docstring).

    Raises:
        ValueError: not bytes, or a layout torch does not write.
    """
    if not isinstance(handle, (bytes, bytearray)):
        raise ValueError(f"a CUDA storage handle is bytes, got {type(handle).__name__}")
    raw = bytes(handle)
    if len(raw) == _CUDA_IPC_HANDLE_BYTES:
        return TorchHandle(version=None, kind="c", cuda_handle=raw)
    if len(raw) >= 2 and raw[1:2] == b"e":
        return TorchHandle(version=raw[0], kind="e", cuda_handle=None)
    if len(raw) == _CUDA_IPC_HANDLE_BYTES + 2 and raw[1:2] == b"c":
        return TorchHandle(version=raw[0], kind="c", cuda_handle=raw[2:])
    raise ValueError(f"unknown CUDA storage handle layout ({len(raw)} bytes, {raw[:2]!r}...)")


def _with_version(handle: bytes, version: int) -> bytes:
    parsed = parse_torch_handle(handle)
    if parsed.kind != "c" or parsed.version is None:
        raise ValueError(
            "handle_version= can only rewrite a versioned cudaMalloc ('c') handle; this one is "
            + ("an expandable segment: start the trainer with "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" if parsed.kind == "e"
               else "unversioned (written by an old torch): pass handle_version=None")
        )  # fmt: skip
    return bytes([version]) + bytes(handle[1:])


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedStorage:
    """One CUDA storage a payload names: torch's handle, where the storage sits in the
    allocation the handle names, and its address in the sending process."""

    handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    data_ptr: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaIPCPayload:
    """One ``serialized_named_tensors`` entry made on this process's GPU.

    Attributes:
        text: the base64 pickle (what SGLang's TP rank on the same GPU reads).
        device_index: the CUDA device of the tensors, in this process's numbering.
        device_uuid: that device's UUID string (what a ``"uuid"`` payload names).
        nbytes: bytes of tensor data the payload shares.
        storages: the storages the payload's handles name.
        keepalive: the shared buffers; hold them until the engine answered (torch's IPC
            reference count also keeps the memory until the engine dropped its mapping).
    """

    text: str
    device_index: int
    device_uuid: str
    nbytes: int
    storages: tuple[SharedStorage, ...]
    keepalive: tuple[torch.Tensor, ...] = field(repr=False)


class _IPCPickler(_WirePickler):
    """The wire pickler with a CUDA tensor reducer that names the device as SGLang expects and
    always emits torch's ``rebuild_cuda_tensor`` (whether or not SGLang patched it here)."""

    # The pure pickler saves functions through its class-level dispatch table, bypassing an
    # overridden save_global; route them through ours.
    dispatch: ClassVar[dict[Any, Any]] = dict(_WirePickler.dispatch)
    dispatch[types.FunctionType] = lambda self, obj: self.save_global(obj)

    def __init__(self, file: io.BytesIO, *, uuid: str | None, handle_version: int | None) -> None:
        super().__init__(file)
        self._uuid = uuid
        self._handle_version = handle_version
        self.storages: list[SharedStorage] = []
        self.dispatch_table[torch.Tensor] = self._reduce
        self.dispatch_table[torch.nn.Parameter] = self._reduce

    def _reduce(self, t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        assert t.is_cuda, "only CUDA tensors reach the IPC reducer"
        _, args = _torch_reduce_tensor()(t)
        args = list(args)
        if isinstance(args[_DEVICE_ARG], int) and self._uuid is not None:
            args[_DEVICE_ARG] = self._uuid
        if self._handle_version is not None and args[_HANDLE_ARG] is not None:  # None: empty
            args[_HANDLE_ARG] = _with_version(args[_HANDLE_ARG], self._handle_version)
        self.storages.append(
            SharedStorage(
                handle=bytes(args[_HANDLE_ARG] or b""),
                storage_offset_bytes=int(args[9]),
                storage_size_bytes=int(args[8]),
                data_ptr=t.untyped_storage().data_ptr(),
            )
        )
        return _torch_rebuild_cuda_tensor(), tuple(args)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is _torch_rebuild_cuda_tensor():
            # Under torch's own name, which SGLang's allowlist admits and patches on its side.
            self.write(pickle.GLOBAL + f"{_REDUCTIONS}\nrebuild_cuda_tensor\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _check_items(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    items = [(name, t.detach()) for name, t in named_tensors]
    if not items:
        raise ValueError("a CUDA IPC payload needs at least one tensor")
    devices = {t.device for _, t in items}
    if any(d.type != "cuda" for d in devices):
        raise ValueError(
            f"CUDA IPC shares CUDA tensors only, got {sorted(map(str, devices))}: CPU tensors "
            "travel through shared memory (miles_transfer.push.serialize_named_tensors, "
            "HTTPReceiver or ColocatedReceiver)"
        )
    if len(devices) != 1:
        raise ValueError(
            f"one payload holds one GPU's tensors, got {sorted(map(str, devices))}: each "
            "trainer rank sends its own GPU's copy (one payload per engine TP rank)"
        )
    for name, t in items:
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, got {type(name).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name}: only dense strided tensors can be sent, got {t.layout}")
    return items


def serialize_cuda_ipc(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    load_format: str | None = FLATTENED_BUCKET,
    device_ref: str = "uuid",
    handle_version: int | None = None,
) -> CudaIPCPayload:
    """Make one SGLang ``update_weights_from_tensor`` payload of CUDA IPC handles.

    The tensors are copied into one fresh buffer on their GPU (``"flattened_bucket"``: SGLang's
    flattened layout, own dtype when uniform, else aligned bytes) or made contiguous (the plain
    list of ``(name, tensor)``, ``load_format=None``); the caller's tensors are not modified.
    Bits, shapes and dtypes are preserved exactly. The copy runs on the current stream; torch
    records an IPC event there that the engine waits on before reading.

    Args:
        named_tensors: ``(name, tensor)`` pairs, all on one CUDA device, dense.
        load_format: ``"flattened_bucket"`` or ``None`` (the plain list SGLang's
            ``load_weights`` takes).
        device_ref: ``"uuid"`` (default; the engine maps it to its own index, whatever its
            ``CUDA_VISIBLE_DEVICES``) or ``"index"`` (torch's plain int: for receivers without
            SGLang's patch, with the same device numbering as this process).
        handle_version: rewrite the version byte of cudaMalloc handles (``2`` for an engine on
            torch <= 2.12 when this process runs torch 2.13); ``None`` keeps torch's.

    Returns:
        The payload (its ``text`` goes into ``serialized_named_tensors``).

    Raises:
        ValueError: no tensors, CPU or mixed devices, a non-dense tensor, an unknown
            ``load_format`` or ``device_ref``, or a handle ``handle_version`` cannot rewrite.
    """
    if load_format not in (FLATTENED_BUCKET, None):
        raise ValueError(
            f"load_format must be {FLATTENED_BUCKET!r} or None for CUDA IPC, got {load_format!r}"
        )
    if device_ref not in _DEVICE_REFS:
        raise ValueError(f"device_ref must be one of {_DEVICE_REFS}, got {device_ref!r}")
    if handle_version is not None and not 0 <= handle_version <= 255:
        raise ValueError(f"handle_version must be a byte value (0-255), got {handle_version}")
    items = _check_items(named_tensors)
    device = items[0][1].device
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = device_uuid(index)
    with torch.cuda.device(index):
        obj: Any = _flatten(items) if load_format == FLATTENED_BUCKET else _as_list(items)
    keep = (
        (obj["flattened_tensor"],) if load_format == FLATTENED_BUCKET else tuple(t for _, t in obj)
    )
    buf = io.BytesIO()
    pickler = _IPCPickler(
        buf, uuid=uuid if device_ref == "uuid" else None, handle_version=handle_version
    )
    pickler.dump(obj)
    return CudaIPCPayload(
        text=base64.b64encode(buf.getvalue()).decode("ascii"),
        device_index=index,
        device_uuid=uuid,
        nbytes=sum(t.numel() * t.element_size() for t in keep),
        storages=tuple(pickler.storages),
        keepalive=keep,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaIPCRef:
    """The arguments of one ``rebuild_cuda_tensor`` call in a payload (nothing opened)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: int | str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class IPCSpan:
    """Where one named tensor's bytes are: ``nbytes`` at ``offset_bytes`` from the start of the
    allocation that ``ref.handle`` names (contiguous, row-major)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ref: CudaIPCRef
    offset_bytes: int
    nbytes: int


def _ref(*args: Any) -> CudaIPCRef:
    if len(args) != 15:
        raise ValueError(f"rebuild_cuda_tensor takes 15 arguments, the payload has {len(args)}")
    return CudaIPCRef(
        size=tuple(args[1]), stride=tuple(args[2]), storage_offset=int(args[3]), dtype=args[5],
        device=args[6], handle=bytes(args[7] or b""), storage_size_bytes=int(args[8]),
        storage_offset_bytes=int(args[9]), event_handle=bytes(args[13] or b""),
        event_sync_required=bool(args[14]),
    )  # fmt: skip


def _local_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == device:
            return i
    raise ValueError(f"no visible CUDA device has UUID {device} (CUDA_VISIBLE_DEVICES?)")


def _rebuild_local(*args: Any) -> torch.Tensor:
    """torch's rebuild, the device given by UUID or index (what SGLang's patch does)."""
    args = (*args[:_DEVICE_ARG], _local_index(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
    return _torch_rebuild_cuda_tensor()(*args)


class _RefUnpickler(_WireUnpickler):
    def __init__(self, file: io.BytesIO, rebuild: Any) -> None:
        super().__init__(file)
        self._rebuild = rebuild

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REBUILD_NAMES:
            return self._rebuild
        if module == _REDUCTIONS:
            # Opening a CPU payload here would map (and consume) its shared-memory file.
            raise pickle.UnpicklingError(
                f"{module}.{name} is not a CUDA IPC rebuild: a CPU shared-memory payload? "
                "(read those with deserialize_named_tensors)"
            )
        return super().find_class(module, name)


def _load(payload: str | bytes, rebuild: Any) -> Any:
    raw = _payload_bytes(payload)
    try:
        return _RefUnpickler(io.BytesIO(raw), rebuild).load()
    except (pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"payload is not a CUDA IPC weight payload: {e}") from e


def _pairs(obj: Any, load_format: str | None, kind: type) -> list[tuple[str, Any, Any]]:
    """(name, base, metadata-or-None) per tensor, the payload's structure checked."""
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError("a flattened_bucket payload must be {'flattened_tensor', 'metadata'}")
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
        if not isinstance(flat, kind) or not isinstance(metadata, list):
            raise ValueError("flattened_tensor must be a CUDA tensor and metadata a list")
        if not all(isinstance(m, FlattenedTensorMetadata) for m in metadata):
            raise ValueError("metadata must be a list of FlattenedTensorMetadata")
        return [(m.name, flat, m) for m in metadata]
    if not isinstance(obj, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], kind)
        for p in obj
    ):
        raise ValueError("expected a list of (name, CUDA tensor) pairs")
    return [(name, t, None) for name, t in obj]


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major, as torch's ``is_contiguous`` judges it (size-1 dims may have any stride)."""
    if 0 in size:
        return True
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def describe_cuda_ipc(payload: str | bytes, *, load_format: str | None) -> list[IPCSpan]:
    """Parse a CUDA IPC payload without opening anything (no CUDA needed).

    Args:
        payload: one ``serialized_named_tensors`` entry (ours or SGLang's serializer's).
        load_format: ``"flattened_bucket"`` or ``None``.

    Returns:
        One span per named tensor, in the sender's order.

    Raises:
        ValueError: not a CUDA IPC payload of that format, a forbidden global, or a
            non-contiguous tensor.
    """
    spans = []
    for name, ref, meta in _pairs(_load(payload, _ref), load_format, CudaIPCRef):
        itemsize = ref.dtype.itemsize
        if not _is_contiguous(ref.size, ref.stride):
            raise ValueError(f"{name}: the payload's tensor is not contiguous")
        if meta is None:
            start, shape, dtype = ref.storage_offset, ref.size, ref.dtype
            nbytes = torch.Size(shape).numel() * itemsize
        else:
            start, shape, dtype = ref.storage_offset + meta.start_idx, tuple(meta.shape), meta.dtype
            nbytes = (meta.end_idx - meta.start_idx) * itemsize
        spans.append(
            IPCSpan(name=name, shape=tuple(shape), dtype=dtype, ref=ref,
                    offset_bytes=ref.storage_offset_bytes + start * itemsize, nbytes=nbytes)
        )  # fmt: skip
    return spans


def open_cuda_ipc(
    payload: str | bytes, *, load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """Open a CUDA IPC payload in this process (a receiver on the same GPU), as SGLang does.

    The device is resolved by UUID (or taken as an index), the memory mapped through torch's
    IPC rebuild (which waits on the sender's event); the tensors alias the sender's memory:
    copy them into your weights and drop them. Call once per payload (one reference each).

    Raises:
        ValueError: a malformed payload, or a device UUID no visible GPU has.
    """
    out = []
    for name, base, meta in _pairs(_load(payload, _rebuild_local), load_format, torch.Tensor):
        out.append((name, base if meta is None else _reconstruct(base, meta)))
    return out
