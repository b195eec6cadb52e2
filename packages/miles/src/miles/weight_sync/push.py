"""``transfer.method: push``: bucketed full-weight push, checked bit for bit."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from miles.protocols import Trainer
from miles_transfer import SyncReport, WeightReceiver, push_module_weights, push_weights

__all__ = ["PushSync"]


class PushSync:
    """Gather the trainer's full weights on every rank and send them from rank 0 in buckets.

    Args:
        receiver: the engine (or its HTTP receiver) on rank 0; ``None`` on other ranks.
        bucket_bytes: bucket size.
        verify: compare the engine's per-tensor digests with the trainer's after each update.
    """

    def __init__(self, receiver: WeightReceiver | None, *, bucket_bytes: int, verify: bool):
        self.receiver = _Timed(receiver) if receiver is not None else None
        self.bucket_bytes = bucket_bytes
        self.verify = verify

    def sync(self, trainer: Trainer, version: int) -> dict[str, Any]:
        """Push and (optionally) verify; a collective on every rank.

        A trainer with ``named_hf_tensors()`` (Megatron: gathers its TP/PP/EP shards into HF
        names) streams those; otherwise its ``.model`` (an HF module, FSDP2-sharded or not) is
        walked with ``miles_transfer.push_module_weights``.
        """
        if self.receiver is not None:
            self.receiver.seconds = 0.0
        named = getattr(trainer, "named_hf_tensors", None)
        if callable(named):
            report = self._push_stream(named(), str(version))
        else:
            model = getattr(trainer, "model", None)
            if model is None:
                raise TypeError(f"{type(trainer).__name__} has no .model to push weights from")
            report = push_module_weights(
                model,
                self.receiver,
                weight_version=str(version),
                bucket_bytes=self.bucket_bytes,
                verify=self.verify,
            )
        if report is None:
            return {}
        return {
            "weight_version": report.weight_version,
            "bytes": report.bytes,
            "buckets": report.buckets,
            "send_s": report.send_seconds,
            "verify_s": report.verify_seconds,
            "verified": report.verified,
            # The engines apply each bucket between two of their steps and wait for nothing
            # else: the time inside the update calls bounds how long generation paused.
            "engine_pause_s": self.receiver.seconds if self.receiver is not None else 0.0,
        }

    def _push_stream(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: str
    ) -> SyncReport | None:
        # Producing the stream is a collective (gathers): every rank drains it, also when
        # the sending rank fails, so no rank is left waiting.
        if self.receiver is None:
            for _ in stream:
                pass
            return None
        try:
            return push_weights(
                stream,
                self.receiver,
                weight_version=version,
                bucket_bytes=self.bucket_bytes,
                verify=self.verify,
            )
        except BaseException:
            for _ in stream:
                pass
            raise


class _Timed:
    """A receiver that adds up the time its ``update_weights_from_tensor`` calls take."""

    def __init__(self, inner: WeightReceiver) -> None:
        self.inner = inner
        self.dtype = inner.dtype
        self.seconds = 0.0

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.update_weights_from_tensor(
                named_tensors, weight_version=weight_version, flush_cache=flush_cache
            )
        finally:
            self.seconds += time.perf_counter() - t0

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        return self.inner.weights_checksum(names)
