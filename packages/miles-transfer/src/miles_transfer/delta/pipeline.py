"""Run the compute of a delta on a few threads while one thread does the I/O, in order.

Encode and apply read tensors and payload frames on the calling thread (files are read in
order), hand each tensor's compute (compare, compress, patch, checksum: torch kernels, zstd and
xxh3, which release the GIL) to a small thread pool, and consume the results in input order, so
the payload and the result files are written exactly as a serial run writes them.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["MAX_PENDING_BYTES", "default_workers", "ordered_map"]

T = TypeVar("T")
R = TypeVar("R")

# Tensors read ahead and not yet consumed (their bytes, at least one tensor): bounds memory.
MAX_PENDING_BYTES = 256 * 2**20


def default_workers() -> int:
    """Threads for delta compute: ``MILES_DELTA_WORKERS`` if set, else 1 (serial).

    Serial is the default because it measured fastest on the busy 2-core machines here (2
    workers: 0.5-0.7x, interleaved A/B at load 6); on an idle many-core host more workers
    may pay off. The output is identical for any number of workers.
    """
    env = os.environ.get("MILES_DELTA_WORKERS")
    if not env:
        return 1
    if not env.isdigit() or int(env) < 1:
        raise ValueError(f"MILES_DELTA_WORKERS must be a positive integer, got {env!r}")
    return int(env)


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[tuple[T, int]],
    *,
    workers: int,
    max_pending_bytes: int = MAX_PENDING_BYTES,
) -> Iterator[R]:
    """``fn(item)`` for each ``(item, nbytes)``, on ``workers`` threads, yielded in input order.

    At most ``max_pending_bytes`` of items (by their declared size; always at least one) are
    submitted and not yet yielded. With ``workers <= 1`` everything runs on the caller's thread.
    An exception in ``fn`` is raised when its result is reached; the items after it are still
    computed (the pool drains) but not yielded.
    """
    if workers <= 1:
        for item, _ in items:
            yield fn(item)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="miles-delta") as pool:
        pending: deque[tuple[Future[R], int]] = deque()
        inflight = 0
        try:
            for item, size in items:
                while pending and inflight + size > max_pending_bytes:
                    fut, done = pending.popleft()
                    inflight -= done
                    yield fut.result()
                pending.append((pool.submit(fn, item), size))
                inflight += size
            while pending:
                fut, _ = pending.popleft()
                yield fut.result()
        finally:
            for fut, _ in pending:
                fut.cancel()
