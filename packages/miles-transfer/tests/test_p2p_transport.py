"""P2P transports: every rank receives exactly its shards, bit for bit, bucket by bucket."""

from __future__ import annotations

import os

import pytest
import torch
from p2p_testutil import DENSE, MOE, make_transports, module_with, random_bits, run_threads

from miles_transfer import ShardReceiver, ShardSender, plan_transfer, tensor_digest
from miles_transfer.p2p import TransferReport, module_buffers, module_param_specs
from miles_transfer.p2p.layouts import (
    fsdp_layout,
    materialize,
    megatron_layout,
    qwen3_params,
    replicated_layout,
    sglang_layout,
)
from miles_transfer.p2p.transports import InProcessHub, TransportError, mooncake_available

KINDS = [
    "inprocess",
    "tcp",
    "shm",
    pytest.param(
        "mooncake",
        marks=pytest.mark.skipif(
            not mooncake_available(),
            reason="Mooncake's transfer engine is not installed: "
            "pip install 'miles-transfer[mooncake]'",
        ),
    ),
]


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("miles-p2p-")}


@pytest.mark.parametrize("kind", KINDS)
def test_each_rollout_rank_receives_exactly_its_shards(kind):
    before = _shm_files()
    plan = plan_transfer(megatron_layout(MOE, tp=2, ep=2), sglang_layout(MOE, tp=2, ep=2, dp=2))
    world = plan.src.world_size + plan.dst.world_size
    transports = make_transports(kind, world)
    try:
        for step in range(2):  # the second step reuses connections and staging buffers
            full = random_bits(qwen3_params(MOE), seed=step)
            shards = {s: materialize(plan.src, s, full) for s in range(plan.src.world_size)}
            buffers = {d: plan.dst.rank(d).allocate() for d in range(plan.dst.world_size)}
            if step == 0:
                out = run_threads(plan, transports, shards, buffers, bucket_bytes=512)
                senders = receivers = None
            else:
                out = run_threads(
                    plan, transports, shards, buffers, bucket_bytes=512,
                    senders=senders, receivers=receivers,
                )  # fmt: skip
            errors = {k: v for k, v in out.items() if isinstance(v, BaseException)}
            assert not errors, errors
            for d, bufs in buffers.items():
                want = materialize(plan.dst, d, full)
                for name, t in want.items():
                    assert tensor_digest(bufs[name]) == tensor_digest(t), (kind, d, name)
                rep = out[("recv", d)]
                assert isinstance(rep, TransferReport)
                assert rep.bytes == plan.bytes_needed(d)
                assert len(rep.buckets) > 1
                assert all(b.nbytes <= 512 for b in rep.buckets)
                assert {b.peer for b in rep.buckets} == set(plan.sources_of(d))
            sent = sum(r.bytes for k, r in out.items() if k[0] == "send")  # type: ignore[union-attr]
            assert sent == sum(plan.bytes_needed(d) for d in buffers)
    finally:
        for t in transports:
            t.close()
    assert _shm_files() == before


def test_p2p_into_an_engine_module_tp1():
    """The embedded engine's layout (TP 1, HF names): writes land in the module's own weights."""
    params = qwen3_params(DENSE)
    full = random_bits(params, 5)
    engine = module_with({n: torch.zeros(s.shape, dtype=s.dtype) for n, s in params.items()})
    plan = plan_transfer(fsdp_layout(params, 2), replicated_layout(module_param_specs(engine)))
    transports = make_transports("inprocess", 3)
    shards = {s: materialize(plan.src, s, full) for s in range(2)}
    out = run_threads(plan, transports, shards, {0: module_buffers(engine)}, bucket_bytes=4096)
    assert not [v for v in out.values() if isinstance(v, BaseException)]
    got = {n: tensor_digest(t) for n, t in engine.state_dict().items()}
    assert got == {n: tensor_digest(t) for n, t in full.items()}


def test_depth_one_and_large_buckets_work_too():
    plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 3), sglang_layout(DENSE, tp=4))
    full = random_bits(qwen3_params(DENSE), 9)
    world = plan.src.world_size + plan.dst.world_size
    shards = {s: materialize(plan.src, s, full) for s in range(3)}
    for depth, bucket in ((1, 100), (3, 1 << 30)):
        buffers = {d: plan.dst.rank(d).allocate() for d in range(4)}
        out = run_threads(
            plan, make_transports("tcp", world), shards, buffers, bucket_bytes=bucket, depth=depth
        )
        assert not [v for v in out.values() if isinstance(v, BaseException)]
        for d in range(4):
            want = materialize(plan.dst, d, full)
            assert all(
                torch.equal(want[n].view(torch.int16), buffers[d][n].view(torch.int16))
                for n in want
            )


def test_size_mismatch_fails_loudly_on_both_ends():
    hub = InProcessHub(2, timeout=10)
    a, b = hub.transport(0), hub.transport(1)
    import threading

    err: list[BaseException] = []

    def recv() -> None:
        try:
            b.recv(0, torch.empty(8, dtype=torch.uint8))
        except TransportError as e:
            err.append(e)

    t = threading.Thread(target=recv)
    t.start()
    with pytest.raises(TransportError, match="sent 4 bytes, rank 1 expected 8"):
        a.send(1, torch.zeros(4, dtype=torch.uint8))
    t.join()
    assert err
    assert "expected 8" in str(err[0])
    with pytest.raises(ValueError, match="uint8"):
        a.send(1, torch.zeros(4, dtype=torch.float32))


def test_a_receiver_whose_sender_never_comes_times_out():
    plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 1), sglang_layout(DENSE, tp=1))
    hub = InProcessHub(2, timeout=0.5)
    recv = ShardReceiver(plan, 0, hub.transport(1), bucket_bytes=1 << 20)
    with pytest.raises(TransportError, match="nothing from rank 0"):
        recv.receive(plan.dst.rank(0).allocate())
    send = ShardSender(plan, 0, hub.transport(0), bucket_bytes=1 << 20)
    with pytest.raises(TransportError, match="posted no receive"):
        send.send(materialize(plan.src, 0, random_bits(qwen3_params(DENSE))))
    with pytest.raises(ValueError, match="depth"):
        ShardSender(plan, 0, hub.transport(0), depth=0)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        ShardReceiver(plan, 3, hub.transport(1))


@pytest.mark.skipif(not mooncake_available(), reason="Mooncake's transfer engine is not installed")
def test_mooncake_reregisters_memory_that_was_freed_and_reused():
    """A receive buffer over memory an earlier, freed buffer was registered on still works.

    The allocator hands freed memory out again; Mooncake refuses a registration that overlaps
    an existing one. Two windows over one bytearray are storages that overlap in the same way.
    """
    import threading

    sender, receiver = make_transports("mooncake", 2)
    backing = bytearray(8192)
    try:
        for offset, fill in ((0, 7), (2048, 9), (1024, 11)):
            dst = torch.frombuffer(backing, dtype=torch.uint8, count=4096, offset=offset)
            src = torch.full((4096,), fill, dtype=torch.uint8)
            err: list[BaseException] = []

            def recv(dst: torch.Tensor = dst, err: list[BaseException] = err) -> None:
                try:
                    receiver.recv(0, dst)
                except BaseException as e:  # reported below
                    err.append(e)

            t = threading.Thread(target=recv)
            t.start()
            sender.send(1, src)
            t.join(60)
            assert not err, err
            assert torch.equal(dst, src), offset
    finally:
        sender.close()
        receiver.close()
