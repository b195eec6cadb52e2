"""Push a stream of named tensors into a receiver, bucket by bucket, then verify bit for bit."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from miles_transfer.digest import tensor_digest
from miles_transfer.protocols import WeightReceiver
from miles_transfer.push.state import bucketize, iter_full_state

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SyncReport",
    "WeightMismatchError",
    "push_module_weights",
    "push_weights",
]

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Default bucket size (512 MiB), the size slime and Miles use for tensor weight updates."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncReport:
    """What one ``push_weights`` call did.

    Attributes:
        weight_version: the version the receiver now serves.
        tensors: number of tensors sent.
        buckets: number of ``update_weights_from_tensor`` calls.
        bytes: payload bytes sent (after casting to the receiver's dtype).
        send_seconds: wall time of casting, digesting and sending (includes producing the stream,
            e.g. FSDP gathers).
        verify_seconds: wall time of the checksum round trip and comparison (0 when not verified).
        verified: whether the receiver's checksums were compared and all matched.
    """

    weight_version: str
    tensors: int
    buckets: int
    bytes: int
    send_seconds: float
    verify_seconds: float
    verified: bool

    def summary(self) -> str:
        """One line for logs."""
        mib = self.bytes / 2**20
        check = "verified bit-exact" if self.verified else "not verified"
        return (
            f"weights v{self.weight_version}: {self.tensors} tensors, {mib:.1f} MiB in "
            f"{self.buckets} buckets, send {self.send_seconds:.3f}s, "
            f"verify {self.verify_seconds:.3f}s, {check}"
        )


class WeightMismatchError(RuntimeError):
    """The receiver's weights differ from what was sent (names in ``mismatched``, sender order)."""

    def __init__(self, mismatched: list[str], total: int) -> None:
        self.mismatched = mismatched
        shown = ", ".join(mismatched[:5])
        more = f" and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""
        super().__init__(
            f"{len(mismatched)} of {total} tensors differ on the receiver after the update: "
            f"{shown}{more}"
        )


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def _lookahead(
    buckets: Iterator[list[tuple[str, torch.Tensor]]],
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield ``(bucket, is_last)``; holds one bucket ahead so the last one can carry the version."""
    prev = next(buckets, None)
    while prev is not None:
        nxt = next(buckets, None)
        yield prev, nxt is None
        prev = nxt


def push_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    receiver: WeightReceiver,
    *,
    weight_version: str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    verify: bool = True,
    flush_cache: bool = True,
) -> SyncReport:
    """Send named tensors (HF names) to a receiver in buckets, then check it holds exactly them.

    Floating-point tensors are cast to ``receiver.dtype`` first (other dtypes go as they are);
    the digests are taken of what is sent. Buckets go in order; ``weight_version`` and
    ``flush_cache`` ride on the last bucket only, so the receiver switches version when the
    update is complete. The stream is consumed lazily: about two buckets are held at a time.

    With ``verify``, the receiver's ``weights_checksum`` for the sent names is compared with the
    sender's ``tensor_digest`` of each tensor. Receivers without checksums (a stock SGLang server)
    need ``verify=False``.

    Args:
        named_tensors: ``(name, tensor)`` pairs; names must be unique.
        receiver: where the weights go.
        weight_version: the version the receiver serves afterwards (e.g. ``str(step)``).
        bucket_bytes: bucket size limit; a larger tensor travels alone.
        verify: compare checksums after the update.
        flush_cache: ask the receiver to drop its KV/prefix cache with the last bucket.

    Returns:
        A ``SyncReport``.

    Raises:
        ValueError: no tensors, or a duplicated name.
        WeightMismatchError: ``verify`` found tensors that differ (or are missing) on the receiver.
    """
    dtype = receiver.dtype
    expected: dict[str, str] = {}

    def cast_and_digest() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors:
            if name in expected:
                raise ValueError(f"tensor name {name!r} appears twice in the stream")
            t = _cast(t.detach(), dtype)
            expected[name] = tensor_digest(t)
            yield name, t

    start = time.perf_counter()
    n_buckets = n_bytes = 0
    for bucket, is_last in _lookahead(bucketize(cast_and_digest(), bucket_bytes)):
        receiver.update_weights_from_tensor(
            bucket,
            weight_version=weight_version if is_last else None,
            flush_cache=flush_cache if is_last else False,
        )
        n_buckets += 1
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    send_seconds = time.perf_counter() - start
    if not expected:
        raise ValueError("push_weights got no tensors to send")

    verify_seconds = 0.0
    if verify:
        start = time.perf_counter()
        got = receiver.weights_checksum(list(expected))
        bad = [name for name, digest in expected.items() if got.get(name) != digest]
        verify_seconds = time.perf_counter() - start
        if bad:
            raise WeightMismatchError(bad, len(expected))
    return SyncReport(
        weight_version=weight_version,
        tensors=len(expected),
        buckets=n_buckets,
        bytes=n_bytes,
        send_seconds=send_seconds,
        verify_seconds=verify_seconds,
        verified=verify,
    )


def push_module_weights(
    module: torch.nn.Module,
    receiver: WeightReceiver | None,
    *,
    weight_version: str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    verify: bool = True,
    flush_cache: bool = True,
) -> SyncReport | None:
    """Push a (possibly FSDP2-sharded) module's full weights; call it on every rank.

    Every rank walks ``iter_full_state(module)`` (the gathers are collectives); only the rank
    that passes a receiver (normally rank 0) sends. If the sending side fails, it still finishes
    the walk before re-raising, so the other ranks are not left waiting in a collective. Only the
    sending rank sees the error: broadcast it yourself if every rank must stop.

    Args:
        module: the trained model.
        receiver: the engine on the sending rank; ``None`` on every other rank.
        weight_version: see ``push_weights``.
        bucket_bytes: see ``push_weights``.
        verify: see ``push_weights``.
        flush_cache: see ``push_weights``.

    Returns:
        The ``SyncReport`` on the sending rank, ``None`` elsewhere.
    """
    # Every rank gathers in the module's own dtype (the others do not know the receiver's);
    # push_weights casts after the gather on the sending rank.
    stream = iter_full_state(module)
    if receiver is None:
        for _ in stream:
            pass
        return None
    try:
        return push_weights(
            stream,
            receiver,
            weight_version=weight_version,
            bucket_bytes=bucket_bytes,
            verify=verify,
            flush_cache=flush_cache,
        )
    except BaseException:
        for _ in stream:  # keep the collectives matched on the other ranks
            pass
        raise
