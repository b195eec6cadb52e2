"""step() with offload="nvme" streams: while bucket i is updated, bucket i+1 is read and bucket
i-1 written, and at most `POOL_BUFFERS` bucket buffers are resident (measured by the pipeline),
however many buckets the state has. The buckets still held from the previous step go first and
are not read again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from _offload_testlib import (
    HYPER,
    TINY_BUCKET_MB,
    make_params,
    reference,
    run,
    set_grads,
    skip_for,
)

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
    real_read, real_visit = store._read, store.visit
    read_done: list[threading.Event] = []
    written: list[threading.Event] = []

    def read(i: int, buf: torch.Tensor, **kw: Any) -> dict[str, Any]:
        meta = real_read(i, buf, **kw)
        read_done[i].set()
        return meta

    overlapped: list[int] = []
    unread: list[int] = []

    def visit(order: list[int], fn: Any, **kw: Any) -> None:
        # The buckets still held from the last pass go first and are not read again.
        kept = set(store._kept)
        assert kw.get("reorder")
        assert len(kept) == mo.POOL_BUFFERS
        eff = [i for i in order if i in kept] + [i for i in order if i not in kept]
        unread[:] = [i for i in eff if i in kept]

        def update(bucket: Any, buf: torch.Tensor) -> None:
            k = eff.index(bucket.index)
            # Inside the update of the k-th bucket, before it proceeds: the next one arrives
            # and the previous one is stored. A pipeline that read or wrote only between
            # updates would never get here.
            if k + 1 < n and eff[k + 1] not in kept:
                nxt = eff[k + 1]
                assert read_done[nxt].wait(WAIT_S), f"bucket {nxt} not read during update {k}"
            if k >= 1:
                prev = eff[k - 1]
                assert written[prev].wait(WAIT_S), f"bucket {prev} not written during update {k}"
            assert not written[bucket.index].is_set()
            overlapped.append(bucket.index)
            fn(bucket, buf)

        real_visit(order, update, **kw)
        assert overlapped == eff
        assert [i for i in range(n) if read_done[i].is_set()] == sorted(set(eff) - kept)
        # The next pass holds the last buckets written.
        assert set(store._kept) == set(eff[-mo.POOL_BUFFERS :])

    store._read = read  # type: ignore[method-assign]
    store._after_write = lambda i: written[i].set()
    store.visit = visit  # type: ignore[method-assign]
    for step in range(3):
        read_done[:] = [threading.Event() for _ in range(n)]
        written[:] = [threading.Event() for _ in range(n)]
        overlapped.clear()
        before = opt.io_stats()
        set_grads(params, step, skip=skip_for(step))  # step 1: two parameters without grads
        opt.step()
        opt.zero_grad()
        after = opt.io_stats()
        # Every stepped bucket written, all but the held ones read (headers and payloads).
        assert [i for i in range(n) if written[i].is_set()] == sorted(overlapped)
        assert len(overlapped) == n or (step == 1 and n // 2 < len(overlapped) < n)
        stepped = sum(opt._buckets[i].nbytes for i in overlapped)
        held = sum(opt._buckets[i].nbytes for i in unread)
        assert len(unread) == mo.POOL_BUFFERS
        assert after["bytes_written"] - before["bytes_written"] == stepped
        assert after["bytes_read"] - before["bytes_read"] == stepped - held
    # Same bits as torch after these pipelined steps.
    want_p, _ = reference(3)
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
