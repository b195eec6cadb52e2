"""Handle-level CUDA IPC with ``cuda-python``: device, pointer and allocation checks of a
payload on the sending side, and reading a payload's bytes on the receiving side without torch.

Optional (``pip install 'miles-transfer[cuda]'``) and imported on first use only: importing
miles-transfer never imports ``cuda`` nor initialises CUDA. What torch does for us (making the
handles, the IPC event, rebuilding tensors) stays torch's; this module checks it independently:

- ``check_payload`` (sender): for every storage a payload names, the device's UUID as the CUDA
  runtime reports it equals the payload's, the pointer is device memory (``cudaMalloc``, which
  IPC can share; managed or host memory cannot) on that device, and the allocation containing it
  starts exactly ``storage_offset_bytes`` before it (what the receiver adds to the mapped base).
- ``read_span`` (receiver, another process): open the sender's IPC event and wait on it (the
  sender's stream ordering), open the memory handle (``cudaIpcOpenMemHandle``), copy the span to
  the host, close the handle. Bytes equal to the sender's prove the payload means what it says.
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import Any

from miles_transfer.push.cuda_ipc import CudaIPCPayload, IPCSpan, parse_torch_handle

__all__ = ["check_payload", "device_uuid", "read_span", "runtime"]

_INSTALL = "pip install 'miles-transfer[cuda]'"


def runtime() -> ModuleType:
    """The CUDA runtime bindings of ``cuda-python`` >= 12.8 (``cuda.bindings.runtime``).

    Raises:
        ImportError: cuda-python is not installed (the message names the pip install).
    """
    try:
        from cuda.bindings import runtime as rt
    except ImportError as e:
        raise ImportError(f"the CUDA IPC handle checks need cuda-python: {_INSTALL}") from e
    return rt


def _driver() -> ModuleType:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError(f"the CUDA IPC handle checks need cuda-python: {_INSTALL}") from e
    return driver


def _ok(api: ModuleType, what: str, result: Any) -> Any:
    """Unpack cuda-python's ``(error, *values)``; raise RuntimeError naming the call."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        describe = getattr(api, "cudaGetErrorString", None) or api.cuGetErrorString
        _, msg = describe(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise RuntimeError(f"{what} failed: {err!r}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_uuid(index: int) -> str:
    """The device's UUID from the CUDA runtime, in torch's text form (what SGLang compares)."""
    rt = runtime()
    props = _ok(rt, f"cudaGetDeviceProperties({index})", rt.cudaGetDeviceProperties(index))
    return _format_uuid(bytes(props.uuid.bytes)[:16])


def _device_by_uuid(rt: ModuleType, uuid: str) -> int:
    count = _ok(rt, "cudaGetDeviceCount", rt.cudaGetDeviceCount())
    for i in range(count):
        if device_uuid(i) == uuid:
            return i
    raise ValueError(f"no visible CUDA device has UUID {uuid} (CUDA_VISIBLE_DEVICES?)")


def check_payload(payload: CudaIPCPayload) -> None:
    """Check, with the CUDA runtime and driver, that a payload names what it should.

    Raises:
        ImportError: cuda-python is missing (the message names the pip install).
        ValueError: a check failed (the message names the storage and what differed).
        RuntimeError: a CUDA call failed.
    """
    rt, drv = runtime(), _driver()
    uuid = device_uuid(payload.device_index)
    if uuid != payload.device_uuid:
        raise ValueError(
            f"device {payload.device_index}: the CUDA runtime reports UUID {uuid}, torch "
            f"{payload.device_uuid} (different device numbering: CUDA_DEVICE_ORDER?)"
        )
    device_type = rt.cudaMemoryType.cudaMemoryTypeDevice
    for i, s in enumerate(payload.storages):
        if not s.handle:
            continue  # an empty storage: nothing is shared
        kind = parse_torch_handle(s.handle).kind
        attrs = _ok(rt, "cudaPointerGetAttributes", rt.cudaPointerGetAttributes(s.data_ptr))
        if attrs.type != device_type or attrs.device != payload.device_index:
            raise ValueError(
                f"storage {i}: memory of type {attrs.type!r} on device {attrs.device}, not "
                f"cudaMalloc memory on device {payload.device_index}: CUDA IPC cannot share it"
            )
        if kind != "c":
            continue  # an expandable segment: its handle is not a cudaIpcMemHandle_t
        base, size = _ok(drv, "cuMemGetAddressRange", drv.cuMemGetAddressRange(s.data_ptr))
        if int(base) != s.data_ptr - s.storage_offset_bytes:
            raise ValueError(
                f"storage {i}: its allocation starts at {int(base):#x}, but the payload says "
                f"{s.data_ptr - s.storage_offset_bytes:#x} (offset {s.storage_offset_bytes})"
            )
        if s.storage_offset_bytes + s.storage_size_bytes > int(size):
            raise ValueError(f"storage {i}: extends past the end of its {int(size)}-byte block")


def read_span(span: IPCSpan) -> bytes:
    """Read one named tensor's bytes through its IPC handle (in a process other than the
    sender's, on the same host), after waiting on the sender's IPC event.

    Raises:
        ImportError: cuda-python is missing.
        ValueError: the handle is not a cudaMalloc one, or the device is not visible.
        RuntimeError: a CUDA call failed.
    """
    rt = runtime()
    if span.nbytes == 0:
        return b""  # an empty tensor: its storage may have no handle at all
    ref = span.ref
    cuda_handle = parse_torch_handle(ref.handle).cuda_handle
    if cuda_handle is None:
        raise ValueError(f"{span.name}: an expandable-segment handle cannot be opened here")
    device = ref.device if isinstance(ref.device, int) else _device_by_uuid(rt, ref.device)
    _ok(rt, f"cudaSetDevice({device})", rt.cudaSetDevice(device))
    if ref.event_sync_required and len(ref.event_handle) == 64:
        ev_handle = rt.cudaIpcEventHandle_t()
        ctypes.memmove(ev_handle.getPtr(), ref.event_handle, 64)
        event = _ok(rt, "cudaIpcOpenEventHandle", rt.cudaIpcOpenEventHandle(ev_handle))
        try:
            _ok(rt, "cudaEventSynchronize", rt.cudaEventSynchronize(event))
        finally:
            _ok(rt, "cudaEventDestroy", rt.cudaEventDestroy(event))
    mem_handle = rt.cudaIpcMemHandle_t()
    ctypes.memmove(mem_handle.getPtr(), cuda_handle, 64)
    flags = rt.cudaIpcMemLazyEnablePeerAccess
    base = _ok(rt, "cudaIpcOpenMemHandle", rt.cudaIpcOpenMemHandle(mem_handle, flags))
    try:
        out = bytearray(span.nbytes)
        if span.nbytes:
            host = (ctypes.c_char * span.nbytes).from_buffer(out)
            kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            src = int(base) + span.offset_bytes
            _ok(rt, "cudaMemcpy", rt.cudaMemcpy(ctypes.addressof(host), src, span.nbytes, kind))
    finally:
        _ok(rt, "cudaIpcCloseMemHandle", rt.cudaIpcCloseMemHandle(base))
    return bytes(out)
