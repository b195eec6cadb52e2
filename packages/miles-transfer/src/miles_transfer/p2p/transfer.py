"""P2P weight transfer: each trainer rank sends, each rollout rank receives only its shards.

The transfer group holds the plan's source (trainer) ranks first, then its destination
(rollout) ranks: source rank s is group rank s, destination rank d is group rank
`plan.src.world_size + d` (`src_peer` / `dst_peer`).

`ShardSender(plan, s, transport).send(shards)` walks the buckets of every destination it
serves (round-robin over destinations, bucket by bucket), packs each bucket into a staging
buffer (the re-sharding copy) and hands it to a sender thread, so packing bucket k+1 overlaps
sending bucket k (`depth` staging buffers). `ShardReceiver(plan, d, transport).receive(buffers)`
runs one receiving thread per source and unpacks each bucket into the rank's own buffers as it
lands. Both ends derive the same bucket list from the plan, so only data travels. Staging
buffers are allocated once per sender/receiver object and reused every step (first-touch page
faults cost more than the copies). Each call returns a `TransferReport` with per-bucket timing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from miles_transfer.p2p.plan import TransferPlan
from miles_transfer.p2p.reshard import Backend, CopyProgram, copy_ops
from miles_transfer.p2p.transports.base import Transport

__all__ = [
    "DEFAULT_P2P_BUCKET_BYTES",
    "BucketTiming",
    "ShardReceiver",
    "ShardSender",
    "TransferReport",
    "dst_peer",
    "reshard_local",
    "src_peer",
]

DEFAULT_P2P_BUCKET_BYTES = 64 << 20


def src_peer(plan: TransferPlan, src_rank: int) -> int:
    """Group rank of source (trainer) rank src_rank."""
    return src_rank


def dst_peer(plan: TransferPlan, dst_rank: int) -> int:
    """Group rank of destination (rollout) rank dst_rank."""
    return plan.src.world_size + dst_rank


@dataclass(kw_only=True, slots=True)
class BucketTiming:
    """One bucket: its peer (source or destination rank), index, size and times in seconds.

    `copy_s` is the pack (sender) or unpack (receiver) time, `transfer_s` the transport call
    (including waiting for the peer).
    """

    peer: int
    index: int
    nbytes: int
    copy_s: float
    transfer_s: float


@dataclass(kw_only=True, slots=True)
class TransferReport:
    """What one rank moved in one call: bytes, wall time, and per-bucket timing."""

    role: str
    rank: int
    bytes: int
    seconds: float
    buckets: list[BucketTiming] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        copy = sum(b.copy_s for b in self.buckets)
        xfer = sum(b.transfer_s for b in self.buckets)
        return (
            f"{self.role} rank {self.rank}: {self.bytes / 2**20:.1f} MiB in {len(self.buckets)} "
            f"buckets, {self.seconds:.3f} s ({self.gb_per_s:.2f} GB/s; copy {copy:.3f} s, "
            f"transport {xfer:.3f} s)"
        )


def _staging(n: int, depth: int, device: torch.device, pin: bool) -> list[torch.Tensor]:
    bufs = []
    for _ in range(depth):
        b = torch.empty(
            n,
            dtype=torch.uint8,
            device=device,
            pin_memory=pin and device.type == "cpu" and torch.cuda.is_available(),
        )
        if device.type == "cpu" and n:
            b.fill_(0)  # pre-fault: first-touch page faults are slower than the copies
        bufs.append(b)
    return bufs


class ShardSender:
    """A trainer rank's side of P2P transfer (see the module docstring).

    Args:
        plan: the transfer plan (`plan_transfer(trainer_layout, rollout_layout)`).
        rank: this source rank in plan.src.
        transport: this rank's endpoint (group rank `src_peer(plan, rank)`).
        bucket_bytes: the most bytes one message carries (copies are split to fit).
        depth: staging buffers, i.e. buckets in flight while the next is packed (>= 1).
        backend: re-sharding backend ("auto" | "native" | "torch").
        threads: native copy threads (default torch.get_num_threads()).
        device: where staging buffers live (default: the shards' device on first send).
        pin_memory: pin CPU staging buffers (faster host-to-device transports; ignored
            without CUDA).
    """

    def __init__(
        self,
        plan: TransferPlan,
        rank: int,
        transport: Transport,
        *,
        bucket_bytes: int = DEFAULT_P2P_BUCKET_BYTES,
        depth: int = 2,
        backend: Backend = "auto",
        threads: int | None = None,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        plan.src.rank(rank)
        self.plan, self.rank, self.transport = plan, rank, transport
        self.backend, self.threads, self.pin = backend, threads, pin_memory
        self.depth = depth
        self._device = None if device is None else torch.device(device)
        targets = plan.targets_of(rank)
        per = {d: plan.buckets(rank, d, bucket_bytes) for d in targets}
        start = rank % len(targets) if targets else 0
        order = targets[start:] + targets[:start]
        # Each bucket compiled once: later steps only resolve base addresses.
        self.items: list[tuple[int, int, CopyProgram]] = [
            (d, i, CopyProgram(per[d][i], "pack"))
            for i in range(max((len(v) for v in per.values()), default=0))
            for d in order
            if i < len(per[d])
        ]
        self._cap = max((prog.nbytes for _, _, prog in self.items), default=0)
        self._bufs: list[torch.Tensor] | None = None

    def send(self, shards: Mapping[str, torch.Tensor]) -> TransferReport:
        """Send this rank's shards (local name -> tensor, as in plan.src) to every destination."""
        t0 = time.perf_counter()
        if self._bufs is None:
            dev = self._device or next(iter(shards.values()), torch.empty(0)).device
            self._bufs = _staging(self._cap, self.depth, dev, self.pin)
        free: queue.Queue[torch.Tensor] = queue.Queue()
        for b in self._bufs:
            free.put(b)
        timings: list[BucketTiming] = []
        todo: queue.Queue[tuple[int, int, torch.Tensor, int, float] | None] = queue.Queue()
        errors: list[BaseException] = []

        def transmit() -> None:
            while (item := todo.get()) is not None:
                d, i, buf, n, copy_s = item
                try:
                    if not errors:
                        t = time.perf_counter()
                        self.transport.send(dst_peer(self.plan, d), buf[:n])
                        xfer = time.perf_counter() - t
                        timings.append(
                            BucketTiming(peer=d, index=i, nbytes=n, copy_s=copy_s, transfer_s=xfer)
                        )
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    free.put(buf)  # always: the packing loop waits for it

        worker = threading.Thread(target=transmit, name=f"p2p-send-{self.rank}", daemon=True)
        worker.start()
        total = 0
        try:
            for d, i, prog in self.items:
                buf = free.get()
                if errors:
                    break
                t = time.perf_counter()
                n = prog.run(shards, buf, self.backend, self.threads)
                if buf.device.type == "cuda":
                    torch.cuda.current_stream(buf.device).synchronize()
                todo.put((d, i, buf, n, time.perf_counter() - t))
                total += n
        finally:
            todo.put(None)
            worker.join()
        if errors:
            raise errors[0]
        return TransferReport(
            role="send",
            rank=self.rank,
            bytes=total,
            seconds=time.perf_counter() - t0,
            buckets=timings,
        )


class ShardReceiver:
    """A rollout rank's side of P2P transfer: writes only its shards into its own buffers.

    Args: as ShardSender (`rank` is the destination rank in plan.dst; staging buffers live on
    the buffers' device unless `device` says otherwise).
    """

    def __init__(
        self,
        plan: TransferPlan,
        rank: int,
        transport: Transport,
        *,
        bucket_bytes: int = DEFAULT_P2P_BUCKET_BYTES,
        depth: int = 2,
        backend: Backend = "auto",
        threads: int | None = None,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        plan.dst.rank(rank)
        self.plan, self.rank, self.transport = plan, rank, transport
        self.backend, self.threads, self.pin, self.depth = backend, threads, pin_memory, depth
        self._device = None if device is None else torch.device(device)
        self.per_source = {
            s: [CopyProgram(ops, "unpack") for ops in plan.buckets(s, rank, bucket_bytes)]
            for s in plan.sources_of(rank)
        }
        self._bufs: dict[int, list[torch.Tensor]] | None = None

    def receive(self, buffers: Mapping[str, torch.Tensor]) -> TransferReport:
        """Receive every bucket meant for this rank and unpack it into `buffers` (in place)."""
        t0 = time.perf_counter()
        if self._bufs is None:
            dev = self._device or next(iter(buffers.values()), torch.empty(0)).device
            self._bufs = {
                s: _staging(
                    max((prog.nbytes for prog in b), default=0),
                    min(self.depth, len(b)),
                    dev,
                    self.pin,
                )
                for s, b in self.per_source.items()
            }
        landed: queue.Queue[tuple[int, int, torch.Tensor, int, float] | BaseException] = (
            queue.Queue()
        )
        frees: dict[int, queue.Queue[torch.Tensor]] = {}
        for s, bufs in self._bufs.items():
            frees[s] = queue.Queue()
            for b in bufs:
                frees[s].put(b)
        stop = threading.Event()

        def pull(s: int) -> None:
            try:
                for i, prog in enumerate(self.per_source[s]):
                    buf = frees[s].get()
                    if stop.is_set():
                        return
                    n = prog.nbytes
                    t = time.perf_counter()
                    self.transport.recv(src_peer(self.plan, s), buf[:n])
                    landed.put((s, i, buf, n, time.perf_counter() - t))
            except BaseException as exc:
                landed.put(exc)

        threads = [
            threading.Thread(
                target=pull, args=(s,), name=f"p2p-recv-{self.rank}-from-{s}", daemon=True
            )
            for s in self.per_source
        ]
        for th in threads:
            th.start()
        timings: list[BucketTiming] = []
        total, remaining = 0, sum(len(b) for b in self.per_source.values())
        error: BaseException | None = None
        while remaining:
            got = landed.get()
            if isinstance(got, BaseException):
                error = got
                break
            s, i, buf, n, xfer = got
            t = time.perf_counter()
            self.per_source[s][i].run(buf[:n], buffers, self.backend, self.threads)
            if buf.device.type == "cuda":
                torch.cuda.current_stream(buf.device).synchronize()
            timings.append(
                BucketTiming(
                    peer=s, index=i, nbytes=n, copy_s=time.perf_counter() - t, transfer_s=xfer
                )
            )
            total += n
            remaining -= 1
            frees[s].put(buf)
        if error is not None:
            stop.set()
            for q in frees.values():
                q.put(torch.empty(0, dtype=torch.uint8))
            raise error
        for th in threads:
            th.join()
        return TransferReport(
            role="receive",
            rank=self.rank,
            bytes=total,
            seconds=time.perf_counter() - t0,
            buckets=timings,
        )


def reshard_local(
    plan: TransferPlan,
    shards: Mapping[int, Mapping[str, torch.Tensor]],
    buffers: Mapping[int, Mapping[str, torch.Tensor]],
    *,
    backend: Backend = "auto",
    threads: int | None = None,
) -> int:
    """Everything in one process: copy straight from source shards into destination buffers.

    Args:
        shards: source rank -> its local tensors; buffers: destination rank -> its local
            tensors (only the destination ranks given are filled).

    Returns:
        Bytes copied.
    """
    total = 0
    for d, bufs in buffers.items():
        for s in plan.sources_of(d):
            ops = plan.ops_between(s, d)
            if s not in shards:
                raise ValueError(f"destination rank {d} needs source rank {s}, which was not given")
            copy_ops(ops, shards[s], bufs, backend=backend, threads=threads)
            total += sum(o.nbytes for o in ops)
    return total
