"""step() with offload="nvme" streams: while bucket i is updated, bucket i+1 is read and bucket
i-1 written, and at most `POOL_BUFFERS` bucket buffers are resident (measured by the pipeline),
however many buckets the state has."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from _offload_testlib import HYPER, TINY_BUCKET_MB, make_params, reference, run, set_grads

import miles_offload as mo
from miles_offload._store import NvmeStore

WAIT_S = 60.0  # only reached if the pipeline did not overlap (the test then fails, not hangs)


def test_step_reads_next_and_writes_previous_while_updating(tmp_path: Path) -> None:
    params = make_params()
    opt = mo.AdamW(params, **HYPER, offload="nvme", path=tmp_path, bucket_mb=TINY_BUCKET_MB)
    store = opt._store
    assert isinstance(store, NvmeStore)
    n = opt.num_buckets
    assert n >= 6
    read_done = [threading.Event() for _ in range(n)]
    written = [threading.Event() for _ in range(n)]
    real_read, real_visit = store._read, store.visit

    def read(i: int, buf: torch.Tensor, **kw: Any) -> dict[str, Any]:
        meta = real_read(i, buf, **kw)
        read_done[i].set()
        return meta

    overlapped: list[int] = []

    def visit(order: list[int], fn: Any, **kw: Any) -> None:
        def update(bucket: Any, buf: torch.Tensor) -> None:
            i = bucket.index
            # Inside the update of bucket i, before it proceeds: i+1 arrives and i-1 is stored.
            # A pipeline that read or wrote only between updates would never get here.
            if i + 1 < n:
                assert read_done[i + 1].wait(WAIT_S), f"bucket {i + 1} not read during update {i}"
            if i >= 1:
                assert written[i - 1].wait(WAIT_S), f"bucket {i - 1} not written during update {i}"
            assert not written[i].is_set()
            overlapped.append(i)
            fn(bucket, buf)

        real_visit(order, update, **kw)

    store._read = read  # type: ignore[method-assign]
    store._after_write = lambda i: written[i].set()
    store.visit = visit  # type: ignore[method-assign]
    set_grads(params, 0)
    opt.step()
    assert overlapped == list(range(n))
    assert all(e.is_set() for e in read_done)
    assert all(e.is_set() for e in written)
    # Same bits as torch after that pipelined step.
    want_p, _ = reference(1)
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, want_p))


def test_resident_state_is_bounded_by_the_pool(tmp_path: Path) -> None:
    params = make_params()
    opt = mo.AdamW(params, **HYPER, offload="nvme", path=tmp_path, bucket_mb=TINY_BUCKET_MB)
    run(params, opt, range(3))
    opt.state_dict()
    buffer = max(b.nbytes for b in opt._buckets)
    # Measured by the pipeline (buffers taken from the pool at once), not derived from settings.
    assert buffer <= opt.peak_resident_bytes <= mo.POOL_BUFFERS * buffer
    assert opt.resident_bytes == mo.POOL_BUFFERS * buffer
    assert opt.num_buckets >= 3 * mo.POOL_BUFFERS
    assert opt.resident_bytes < opt.state_bytes / 2
    # Twice the parameters (twice the buckets): the same resident bytes.
    more = make_params() + make_params()
    big = mo.AdamW(more, **HYPER, offload="nvme", path=tmp_path / "big", bucket_mb=TINY_BUCKET_MB)
    for k in range(2):
        set_grads(more, k)
        big.step()
    assert big.state_bytes > 1.9 * opt.state_bytes
    assert big.resident_bytes == mo.POOL_BUFFERS * max(b.nbytes for b in big._buckets)
    assert big.peak_resident_bytes <= big.resident_bytes <= 1.1 * opt.resident_bytes
    # The pipeline's buffers are registered with io_uring: every request is a fixed one.
    stats = opt.io_stats()
    if stats["backend"] == "io_uring":
        assert stats["requests"] > 0
        assert stats["fixed_requests"] == stats["requests"]
    # In RAM every bucket stays resident.
    cpu = mo.AdamW(make_params(), **HYPER, offload="cpu", bucket_mb=TINY_BUCKET_MB)
    assert cpu.resident_bytes == cpu.state_bytes
