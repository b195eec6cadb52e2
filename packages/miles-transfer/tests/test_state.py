"""iter_full_state (plain and FSDP2-sharded) and bucketize."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_transfer import ModuleReceiver, push_module_weights, tensor_digest
from miles_transfer.dist import shutdown_process_group, wait_for_gloo_workers
from miles_transfer.push import WeightMismatchError, bucketize, iter_full_state


def _named(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]


def test_bucketize_respects_the_limit_and_keeps_order():
    buckets = list(bucketize(_named([4, 4, 4, 10, 1, 3, 0, 8]), 8))
    assert [[n for n, _ in b] for b in buckets] == [
        ["t0", "t1"],
        ["t2"],
        ["t3"],  # larger than a bucket: alone
        ["t4", "t5", "t6"],
        ["t7"],
    ]
    for b in buckets:
        size = sum(t.numel() for _, t in b)
        assert size <= 8 or len(b) == 1


def test_bucketize_counts_bytes_not_elements():
    named = [("a", torch.zeros(2, dtype=torch.float32)), ("b", torch.zeros(2, dtype=torch.float32))]
    assert [len(b) for b in bucketize(named, 8)] == [1, 1]
    assert [len(b) for b in bucketize(named, 16)] == [2]


def test_bucketize_edge_cases():
    assert list(bucketize([], 8)) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucketize(_named([1]), 0))


class _Wrapped(torch.nn.Module):
    """Stands in for torch.compile / checkpoint wrappers, which insert name segments."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    m.register_buffer("steps", torch.arange(5))
    return m


def test_iter_full_state_plain_module_names_and_cast():
    m = _tiny()
    got = dict(iter_full_state(_Wrapped(m), dtype=torch.bfloat16))
    assert list(got) == list(m.state_dict())
    assert got["0.weight"].dtype == torch.bfloat16
    assert got["steps"].dtype == torch.int64  # non-float entries are not cast
    assert torch.equal(got["0.weight"], m.state_dict()["0.weight"].to(torch.bfloat16))


def _threads_named(name: str) -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == name
        except OSError:
            pass
    return n


class _FailingReceiver(ModuleReceiver):
    def __init__(self, module: torch.nn.Module, fail_after: int) -> None:
        super().__init__(module)
        self.calls = 0
        self.fail_after = fail_after

    def update_weights_from_tensor(self, named_tensors, **kw):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("engine went away")
        super().update_weights_from_tensor(named_tensors, **kw)


def _fsdp_worker(rank: int, world: int, init: str, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        model = _tiny()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model[0].weight).__name__ == "DTensor"
        full = list(iter_full_state(model))

        # push_module_weights: rank 0 sends, rank 1 only takes part in the gathers.
        receiver = ModuleReceiver(_tiny(seed=1)) if rank == 0 else None
        report = push_module_weights(model, receiver, weight_version="7", bucket_bytes=64)

        # A failing engine on rank 0 must not leave rank 1 stuck in a collective.
        failing = _FailingReceiver(_tiny(seed=1), fail_after=1) if rank == 0 else None
        error = None
        try:
            push_module_weights(model, failing, weight_version="8", bucket_bytes=64)
        except RuntimeError as e:
            error = str(e)
        dist.barrier()
        # Real gloo workers exist under the name the exit helper looks for, and they park.
        gloo_threads = _threads_named("pt_gloo_runloop")
        parked = wait_for_gloo_workers(timeout=30.0)
        if rank == 0:
            assert report is not None
            assert receiver is not None
            torch.save(
                {
                    "full": full,
                    "verified": report.verified,
                    "buckets": report.buckets,
                    "version": receiver.weight_version,
                    "received": receiver.weights_checksum(),
                    "error": error,
                    "gloo_threads": gloo_threads,
                    "parked": parked,
                },
                out_path,
            )
    finally:
        shutdown_process_group()  # a plain destroy_process_group() here aborted once in CI


def test_fsdp2_gather_yields_exactly_the_unsharded_tensors(tmp_path):
    out = str(tmp_path / "rank0.pt")
    init = f"file://{tmp_path / 'pg'}"  # file rendezvous: no port to pick
    mp.spawn(_fsdp_worker, args=(2, init, out), nprocs=2, join=True)
    res = torch.load(out)
    ref = _tiny()
    ref_state = list(ref.state_dict().items())
    assert [n for n, _ in res["full"]] == [n for n, _ in ref_state]
    for (n, got), (_, want) in zip(res["full"], ref_state):
        assert type(got) is torch.Tensor, n
        assert tensor_digest(got) == tensor_digest(want), n
    assert res["verified"]
    assert res["buckets"] > 1
    assert res["version"] == "7"
    assert res["received"] == {n: tensor_digest(t) for n, t in ref_state}
    assert res["error"] == "engine went away"
    assert res["gloo_threads"] > 0
    assert res["parked"]


def test_push_module_weights_plain_module_detects_mismatch():
    class Corrupting(ModuleReceiver):
        def update_weights_from_tensor(self, named_tensors, **kw):
            super().update_weights_from_tensor(named_tensors, **kw)
            with torch.no_grad():
                self.module[2].bias[0] += 1.0

    with pytest.raises(WeightMismatchError, match=r"2\.bias"):
        push_module_weights(_tiny(), Corrupting(_tiny(seed=3)), weight_version="1")
