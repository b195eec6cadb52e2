"""P2P into a whole engine: trainer ranks' shards -> the engine's side -> the engine, bit-exact.

The engine is a real model behind SGLang's weight endpoints (``WeightServer`` over a
``ModuleReceiver``); its receiving side is the real ``miles-transfer p2p-agent`` process (or an
``EngineSink`` thread); the two trainer ranks are threads holding FSDP2-layout shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
from p2p_testutil import MOE, module_with, random_bits

from miles_transfer import tensor_digest
from miles_transfer.p2p import module_param_specs
from miles_transfer.p2p.engine import (
    EngineSink,
    SourceEndpoint,
    fsdp_source,
    megatron_source,
    piece_digests,
    setup_message,
)
from miles_transfer.p2p.layouts import (
    ParamSpec,
    fsdp_layout,
    materialize,
    megatron_layout,
    qwen3_params,
)
from miles_transfer.push import HTTPReceiver, ModuleReceiver, WeightServer
from miles_transfer.push.state import iter_full_state


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 7))


def _shards(
    model: torch.nn.Module, world: int, dtype: torch.dtype
) -> list[dict[str, torch.Tensor]]:
    full = {n: t.to(dtype) for n, t in iter_full_state(model)}
    params = {n: ParamSpec(tuple(t.shape), dtype) for n, t in full.items()}
    src = fsdp_layout(params, world)
    return [materialize(src, s, full) for s in range(world)]


def _send_all(store_of, setup: str, shards: list[dict[str, torch.Tensor]], version: str):
    """Every trainer rank in its own thread; returns rank 0's report (or raises its error)."""
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            ep = SourceEndpoint(store_of(r), r, setup)
            try:
                out[r] = ep.send(shards[r], version)
                if r == 0:
                    ep.stop()
            finally:
                ep.close()
        except BaseException as exc:  # re-raised below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r in range(len(shards)):
        if isinstance(out.get(r), BaseException):
            raise out[r]  # type: ignore[misc]
    return out[0]


def _client(addr: tuple[str, int]):
    def store_of(_: int):
        return torch.distributed.TCPStore(  # type: ignore[attr-defined]
            addr[0], addr[1], is_master=False, timeout=timedelta(seconds=120)
        )

    return store_of


@pytest.mark.slow  # the agent process imports torch: 20-40 s on the busy CI machine
def test_agent_process_swaps_trainer_shards_into_a_server_bit_exact():
    trainer = _model(0)
    engine_model = _model(1).to(torch.bfloat16)
    specs = {n: ParamSpec(s.shape, torch.bfloat16) for n, s in module_param_specs(trainer).items()}
    setup = setup_message(fsdp_source(specs, 2), bucket_bytes=1024, transport="tcp")
    with WeightServer(ModuleReceiver(engine_model)) as server:
        agent = subprocess.Popen(
            [sys.executable, "-m", "miles_transfer.cli", "p2p-agent", "--engine-url", server.url,
             "--parent-pid", str(os.getpid())],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert agent.stdout is not None
            m = re.search(r"ready at (\S+):(\d+)", agent.stdout.readline())
            assert m, "the agent did not print its address"
            addr = (m.group(1), int(m.group(2)))
            # One endpoint per rank for both versions: the sink answers update 1, then 2.
            stores = [_client(addr)(r) for r in range(2)]
            eps = [SourceEndpoint(stores[r], r, setup) for r in range(2)]
            for version in ("1", "2"):
                if version == "2":
                    with torch.no_grad():
                        for p in trainer.parameters():
                            p.add_(0.01)
                shards = _shards(trainer, 2, torch.bfloat16)
                reports: dict[int, object] = {}

                def rank(r: int, shards=shards, version=version, reports=reports) -> None:
                    reports[r] = eps[r].send(shards[r], version)

                threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=300)
                rep = reports[0]
                assert reports[1] is None
                full = {n: t.to(torch.bfloat16) for n, t in iter_full_state(trainer)}
                assert rep.ok  # type: ignore[attr-defined]
                assert rep.verified  # type: ignore[attr-defined]
                assert rep.bytes == sum(t.numel() * 2 for t in full.values())  # type: ignore[attr-defined]
                assert rep.weight_version == version  # type: ignore[attr-defined]
                engine = HTTPReceiver(server.url)
                assert engine.weights_checksum() == {n: tensor_digest(t) for n, t in full.items()}
                assert server.receiver.weight_version == version  # type: ignore[attr-defined]
                assert server.pause_calls[-1] == "in_place"
                assert not server.paused
            eps[0].stop()
            assert agent.wait(timeout=60) == 0
            for ep in eps:
                ep.close()
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


@pytest.fixture
def sink_store():
    """A TCPStore, a real engine behind HTTP and an EngineSink thread factory."""
    store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    return store, _client(("127.0.0.1", int(store.port)))


def _run_sink(engine, store, setup: str) -> threading.Thread:
    sink = EngineSink(engine, store, json.loads(setup))

    def serve() -> None:
        try:
            sink.serve()
        finally:
            sink.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return th


def test_engine_refusal_reaches_the_trainer_and_nothing_changes(sink_store):
    store, store_of = sink_store
    trainer = _model(0)
    engine_model = torch.nn.Sequential(torch.nn.Linear(24, 40))  # lacks "2.weight", "2.bias"
    specs = {n: ParamSpec(s.shape, torch.float32) for n, s in module_param_specs(trainer).items()}
    setup = setup_message(fsdp_source(specs, 2), bucket_bytes=4096, transport="shm")
    with WeightServer(ModuleReceiver(engine_model)) as server:
        engine = HTTPReceiver(server.url)
        before = engine.weights_checksum()
        sink = _run_sink(engine, store, setup)
        with pytest.raises(RuntimeError, match=r"engine side of the P2P update failed.*2\.weight"):
            _send_all(store_of, setup, _shards(trainer, 2, torch.float32), "1")
        assert engine.weights_checksum() == before
        assert server.receiver.weight_version == "0"  # type: ignore[attr-defined]
        assert not server.paused
        store.set("miles-p2p/update/2", json.dumps({"stop": True}))
        sink.join(timeout=60)


def test_a_shard_that_differs_from_its_digest_is_refused(sink_store):
    store, store_of = sink_store
    trainer = _model(0)
    engine_model = _model(1)
    specs = {n: ParamSpec(s.shape, torch.float32) for n, s in module_param_specs(trainer).items()}
    setup = setup_message(fsdp_source(specs, 2), bucket_bytes=4096)
    shards = _shards(trainer, 2, torch.float32)
    with WeightServer(ModuleReceiver(engine_model)) as server:
        engine = HTTPReceiver(server.url)
        before = engine.weights_checksum()
        sink = _run_sink(engine, store, setup)
        eps = [SourceEndpoint(store_of(r), r, setup) for r in range(2)]
        errors: list[BaseException] = []

        def rank0() -> None:
            try:
                eps[0].send(shards[0], "1")
            except RuntimeError as exc:
                errors.append(exc)

        def rank1_corrupted_in_transit() -> None:
            # Rank 1 hashes its shard, but one bit of one element differs on the wire.
            ep = eps[1]
            ep.n += 1
            digests = piece_digests(ep.plan.src.rank(1), shards[1])
            ep.store.set(f"{ep.prefix}/digests/{ep.n}/1", json.dumps(digests))
            bad = {n: t.clone() for n, t in shards[1].items()}
            bad["0.weight"].view(torch.int32)[0, 0] ^= 1
            ep.sender.send(bad)

        threads = [threading.Thread(target=f) for f in (rank0, rank1_corrupted_in_transit)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(errors) == 1
        assert re.search(r"nothing was swapped in: 0\.weight \(trainer rank 1\)$", str(errors[0]))
        assert engine.weights_checksum() == before
        eps[0].stop()
        sink.join(timeout=60)
        for ep in eps:
            ep.close()


def test_megatron_tp2_shards_reach_a_whole_tensor_engine_bit_exact(sink_store):
    """A Megatron TP 2 job (interleaved fused QKV, [gate; up] fc1, padded vocabulary, tied
    embedding) into an engine holding whole HF tensors; the trainer ranks' padding rows hold
    garbage, which is neither moved nor part of the check."""
    store, store_of = sink_store
    shape = dataclasses.replace(MOE, dtype=torch.bfloat16)
    params = qwen3_params(shape)
    full = random_bits(params, seed=3)
    layout = megatron_layout(shape, tp=2)
    shards = []
    for r in range(2):
        local = materialize(layout, r, full)
        emb = local["embedding.word_embeddings.weight"]  # 128 of the 256 padded rows
        first_pad = max(
            0, shape.vocab - r * emb.shape[0]
        )  # vocab 100: rank 0 rows 100.., rank 1 all
        emb[first_pad:].fill_(7.0)
        shards.append(local)
    setup = setup_message(megatron_source(shape, tp=2), bucket_bytes=2048)
    engine_model = module_with({n: torch.zeros(s.shape, dtype=s.dtype) for n, s in params.items()})
    with WeightServer(ModuleReceiver(engine_model)) as server:
        sink = _run_sink(HTTPReceiver(server.url), store, setup)
        rep = _send_all(store_of, setup, shards, "4")
        assert rep.ok, rep.error  # type: ignore[attr-defined]
        assert rep.verified  # type: ignore[attr-defined]
        assert rep.bytes == sum(t.numel() * 2 for t in full.values())  # type: ignore[attr-defined]
        got = HTTPReceiver(server.url).weights_checksum()
        assert got == {n: tensor_digest(t) for n, t in full.items()}
        sink.join(timeout=60)
