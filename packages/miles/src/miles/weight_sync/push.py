"""``transfer.method: push``: bucketed full-weight push, checked bit for bit."""

from __future__ import annotations

from typing import Any

from miles.protocols import Trainer
from miles_transfer import WeightReceiver, push_module_weights

__all__ = ["PushSync"]


class PushSync:
    """Gather the trainer's full weights on every rank and send them from rank 0 in buckets.

    Args:
        receiver: the engine (or its HTTP receiver) on rank 0; ``None`` on other ranks.
        bucket_bytes: bucket size.
        verify: compare the engine's per-tensor digests with the trainer's after each update.
    """

    def __init__(self, receiver: WeightReceiver | None, *, bucket_bytes: int, verify: bool):
        self.receiver = receiver
        self.bucket_bytes = bucket_bytes
        self.verify = verify

    def sync(self, trainer: Trainer, version: int) -> dict[str, Any]:
        """Push and (optionally) verify; a collective on every rank."""
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
        }
