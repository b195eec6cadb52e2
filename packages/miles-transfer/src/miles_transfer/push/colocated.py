"""Push into an SGLang engine that shares the trainer's GPUs (colocated): one payload per TP rank.

The layout slime and Miles use with SGLang: every trainer rank on one of the engine's GPUs
holds the full (gathered) bucket on its own GPU and serialises it there; the engine's source
rank gathers the payloads in TP-rank order and posts ``{"serialized_named_tensors": [payload of
rank 0, payload of rank 1, ...], "load_format": "flattened_bucket", ...}``; SGLang's TP rank
``i`` opens entry ``i``, which names memory on its own GPU. On GPU the payloads hold CUDA IPC
handles (``push/cuda_ipc.py``); CPU tensors travel the same way through shared memory
(``push/wire.py``), one file per rank (a same-host engine on CPU, and the CPU tests).

``ColocatedReceiver`` is a ``WeightReceiver``: every trainer rank of the group calls
``push_weights`` (or ``push_module_weights``) with its own receiver, in the same order; the
calls are collective over the group (``PayloadGroup``: ``SingleProcessGroup`` for a TP 1 engine
beside one trainer process, ``TorchDistGroup`` over a ``torch.distributed`` gloo group).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from miles_transfer._bytes import byte_view
from miles_transfer.push.cuda_ipc import serialize_cuda_ipc
from miles_transfer.push.http import HTTPReceiver, ReceiverError, parse_dtype
from miles_transfer.push.wire import FLATTENED_BUCKET, discard_serialized, serialize_named_tensors

__all__ = ["ColocatedReceiver", "PayloadGroup", "SingleProcessGroup", "TorchDistGroup"]


class PayloadGroup(Protocol):
    """The trainer ranks on one engine's GPUs, in the engine's TP-rank order.

    ``rank`` 0 is the source: it talks to the engine. ``gather`` and ``broadcast`` are
    collective: every rank calls them in the same order.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def gather(self, payload: str) -> list[str] | None:
        """Every rank's payload in rank order on rank 0, ``None`` elsewhere."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable)."""
        ...


class SingleProcessGroup:
    """A TP 1 engine beside one trainer process: nothing to gather."""

    rank = 0
    size = 1

    def gather(self, payload: str) -> list[str] | None:
        return [payload]

    def broadcast(self, obj: Any) -> Any:
        return obj


class TorchDistGroup:
    """A ``torch.distributed`` group (gloo: objects travel on the CPU) whose ranks, in order,
    sit on the engine's TP ranks' GPUs. The group's first rank is the source.

    Args:
        group: the process group; ``None`` for the default (world) group.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("TorchDistGroup needs torch.distributed.init_process_group first")
        self._dist = dist
        self._group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    # torch's gather_object / broadcast_object_list convert through numpy, which neither torch nor
    # miles-transfer depends on: these move pickled bytes as uint8 tensors instead (CPU tensors:
    # the group is gloo, also on NCCL jobs).

    def gather(self, payload: str) -> list[str] | None:
        data = payload.encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._dist.all_gather(sizes, size, group=self._group)
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._dist.all_gather(bufs, mine, group=self._group)
        if self.rank != 0:
            return None
        return [bytes(byte_view(b[: int(n.item())])).decode() for b, n in zip(bufs, sizes)]

    def broadcast(self, obj: Any) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._dist.broadcast(size, src=self._src, group=self._group)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._dist.broadcast(buf, src=self._src, group=self._group)
        # The group's own rank 0 (same job), not a network peer: its pickle is trusted.
        return obj if self.rank == 0 else pickle.loads(bytes(byte_view(buf)))


def _raise_on_every_rank(group: PayloadGroup, error: Exception | None) -> None:
    """Rank 0's error (a ValueError or ReceiverError) raised on every rank of the group."""
    kind, message = group.broadcast(
        (None, None) if error is None else (type(error) is ValueError, str(error))
    )
    if message is not None:
        raise (ValueError if kind else ReceiverError)(message)


class ColocatedReceiver:
    """A ``WeightReceiver`` for an SGLang engine on this trainer group's GPUs (same host).

    Attributes:
        dtype: the precision the engine serves (senders cast to it).
        group: the trainer ranks of this engine.
        engine: the ``HTTPReceiver`` of the engine on the source rank (pause, continue,
            update from disk), ``None`` on the others.
    """

    def __init__(
        self,
        base_url: str | None,
        *,
        dtype: torch.dtype | str,
        group: PayloadGroup | None = None,
        load_format: str | None = FLATTENED_BUCKET,
        device_ref: str = "uuid",
        handle_version: int | None = None,
        check_handles: bool = False,
        timeout: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        """Connect (collective over ``group``: the source checks the engine's ``tp_size``).

        Args:
            base_url: the engine's URL on the source rank (group rank 0); ignored elsewhere.
            dtype: the precision the engine serves, e.g. ``torch.bfloat16``.
            group: the trainer ranks on the engine's GPUs in TP-rank order
                (default ``SingleProcessGroup()``).
            load_format: ``"flattened_bucket"`` (default, one buffer per bucket) or ``None``.
            device_ref: how CUDA payloads name their GPU: ``"uuid"`` (SGLang) or ``"index"``.
            handle_version: see ``serialize_cuda_ipc`` (an engine on an older torch).
            check_handles: check every CUDA payload with cuda-python before sending
                (``push/cuda_runtime.check_payload``; ``pip install 'miles-transfer[cuda]'``).
            timeout: seconds for any one request.
            api_key: sent as ``Authorization: Bearer``.

        Raises:
            ImportError: ``check_handles`` without cuda-python (names the pip install).
            ValueError: a bad argument; no ``base_url`` on the source rank, or an engine whose
                ``tp_size`` differs from the group's size (on every rank).
            ReceiverError: the engine is unreachable (on every rank).
        """
        self.group: PayloadGroup = group if group is not None else SingleProcessGroup()
        self.dtype: torch.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        if load_format not in (FLATTENED_BUCKET, None):
            raise ValueError(
                f"load_format must be {FLATTENED_BUCKET!r} or None (SGLang's pickled formats), "
                f"got {load_format!r}"
            )
        if device_ref not in ("uuid", "index"):
            raise ValueError(f"device_ref must be 'uuid' or 'index', got {device_ref!r}")
        if check_handles:
            from miles_transfer.push.cuda_runtime import runtime

            runtime()  # a missing cuda-python fails here, not at the first update
        self.load_format = load_format
        self.device_ref = device_ref
        self.handle_version = handle_version
        self.check_handles = check_handles
        self.engine: HTTPReceiver | None = None
        error: Exception | None = None
        if self.group.rank == 0:
            try:
                if not base_url:
                    raise ValueError("the source rank (group rank 0) needs the engine's base_url")
                engine = HTTPReceiver(
                    base_url,
                    dtype=self.dtype,
                    load_format=load_format,
                    timeout=timeout,
                    api_key=api_key,
                )
                if engine.tp_size != self.group.size:
                    raise ValueError(
                        f"{base_url} has tp_size={engine.tp_size} but the colocated group has "
                        f"{self.group.size} trainer rank(s): build the group from the trainer "
                        "ranks on the engine's GPUs, one per TP rank, in TP-rank order"
                    )
                self.engine = engine
            except (ReceiverError, ValueError) as e:
                error = e
        _raise_on_every_rank(self.group, error)

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Send one bucket (collective): this rank's payload, gathered and posted by rank 0.

        Raises:
            ValueError: no tensors, or tensors on several devices (on the calling rank).
            ReceiverError: the engine failed or refused the update (on every rank).
        """
        items = [(name, t.detach()) for name, t in named_tensors]
        if not items:
            raise ValueError("update_weights_from_tensor needs at least one tensor")
        on_gpu = items[0][1].is_cuda
        keepalive: object = None
        if on_gpu:
            payload = serialize_cuda_ipc(
                items,
                load_format=self.load_format,
                device_ref=self.device_ref,
                handle_version=self.handle_version,
            )
            if self.check_handles:
                from miles_transfer.push.cuda_runtime import check_payload

                check_payload(payload)
            text, keepalive = payload.text, payload
        else:
            text = serialize_named_tensors(items, load_format=self.load_format, consumers=1)
        payloads = self.group.gather(text)
        status: tuple[str | None, bool] = (None, False)
        if self.engine is not None:
            assert payloads is not None
            assert len(payloads) == self.group.size
            body = {
                "serialized_named_tensors": payloads,
                "load_format": self.load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }
            try:
                self.engine._post_update("/update_weights_from_tensor", body)
            except ReceiverError as e:
                # Not read: refused before the handler (HTTP status other than 200/400).
                status = (str(e), getattr(e, "status", 0) not in (0, 400))
        error, unread = self.group.broadcast(status)
        if unread and not on_gpu:
            discard_serialized(text, load_format=self.load_format)
        del keepalive
        if on_gpu:
            torch.cuda.ipc_collect()  # free blocks whose consumers have let go
        if error is not None:
            raise ReceiverError(error)

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """The engine's digests (the Miles ``/weights_checksum``), on every rank (collective).

        Raises:
            ReceiverError: the engine lacks the endpoint (stock SGLang: push with
                ``verify=False``) or failed, on every rank.
        """
        result: tuple[dict[str, str] | None, str | None] = (None, None)
        if self.engine is not None:
            try:
                result = (self.engine.weights_checksum(names), None)
            except ReceiverError as e:
                result = (None, str(e))
        digests, error = self.group.broadcast(result)
        if error is not None:
            raise ReceiverError(error)
        assert digests is not None
        return digests
