"""``transfer.method: colocated``: the recipe's opt-in and checks, and ``ColocatedSync`` on CPU.

Against miles-transfer's ``WeightServer`` (a real engine-side server over a bf16 module, which
lists the formats it accepts), in one process; and from two gloo trainer processes into an
SGLang-shaped TP 2 server (TP rank ``i`` opens payload ``i``, as SGLang's TP workers do: SGLang
itself does not run here). The embedded engine end to end: ``tests/test_e2e_transfer.py``.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.config import load_recipe
from miles.protocols import Trainer
from miles.weight_sync import ColocatedSync, build_weight_sync
from miles_transfer import HTTPReceiver, ModuleReceiver, tensor_digest
from miles_transfer.push import WeightServer, deserialize_named_tensors

OPT_IN = "transfer.colocated.allow_pickle_weights=true"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["transfer.method=colocated"], "set transfer.colocated.allow_pickle_weights: true"),
        (
            ["transfer.method=colocated", OPT_IN, "transfer.colocated.handle_version=256"],
            "transfer.colocated.handle_version must be a byte value",
        ),
        (
            ["transfer.method=colocated", OPT_IN, "fleet.engines=2"],
            "not a fleet behind a router: remove the fleet section",
        ),
    ],
)
def test_bad_colocated_recipes_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe("arith-tiny", overrides)


def test_the_method_picks_the_colocated_sync() -> None:
    cfg = load_recipe("arith-tiny", ["transfer.method=colocated", OPT_IN])
    sync = build_weight_sync(cfg, None)
    assert isinstance(sync, ColocatedSync)
    assert sync.tp_size is None  # nothing is set up before the first sync


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


class _ModuleTrainer:
    """The part of the Trainer protocol a weight sync reads: a rank holding a module."""

    def __init__(self, model: torch.nn.Module, rank: int, world_size: int) -> None:
        self.model = model
        self.rank = rank
        self.world_size = world_size


def _trainer(model: torch.nn.Module, rank: int = 0, world_size: int = 1) -> Trainer:
    return cast(Trainer, _ModuleTrainer(model, rank, world_size))


def _sync(url: str, receiver: Any) -> ColocatedSync:
    return ColocatedSync(receiver, engine_url=url, bucket_bytes=1024, verify=True)


def test_colocated_into_a_server_on_this_host() -> None:
    model = _model(0)
    engine = ModuleReceiver(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with WeightServer(engine, allow_pickle=True) as server:
        sync = _sync(server.url, HTTPReceiver(server.url))
        for version in (1, 2):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            out = sync.sync(_trainer(model), version)
            assert out["method"] == "colocated"
            assert out["verified"] is True
            assert out["weight_version"] == str(version)
            assert out["payloads"] == 1
            assert out["bytes"] == sum(t.numel() * 2 for t in model.state_dict().values())
            assert out["buckets"] > 1  # 1 KiB buckets
            assert out["engine_pause_s"] > 0
            want = {n: tensor_digest(t.to(torch.bfloat16)) for n, t in model.state_dict().items()}
            assert engine.weights_checksum() == want
            assert engine.weight_version == str(version)
        sync.close()


def test_an_engine_that_refuses_pickles_is_named_before_any_update() -> None:
    engine = ModuleReceiver(_model(1).to(torch.bfloat16), dtype=torch.bfloat16)
    before = engine.weights_checksum()
    with WeightServer(engine) as server:  # miles_safetensors only
        sync = _sync(server.url, HTTPReceiver(server.url))
        with pytest.raises(ValueError, match=r"--allow-pickle-weights"):
            sync.sync(_trainer(_model(0)), 1)
    assert engine.weights_checksum() == before


def test_an_engine_on_another_host_or_with_more_tp_ranks_is_refused() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine; nothing is contacted.
    url = "http://192.0.2.1:30000"
    sync = _sync(url, HTTPReceiver(url, dtype=torch.bfloat16, tp_size=1))
    with pytest.raises(ValueError, match=r"rollout.engine_url=http://192.0.2.1:30000 is not on"):
        sync.sync(_trainer(_model(0)), 1)
    engine = ModuleReceiver(_model(1).to(torch.bfloat16), dtype=torch.bfloat16)
    with WeightServer(engine, allow_pickle=True) as server:
        rx = HTTPReceiver(server.url, dtype=torch.bfloat16, tp_size=2)
        with pytest.raises(ValueError, match=r"tp_size=2 but the trainer has 1 rank"):
            _sync(server.url, rx).sync(_trainer(_model(0)), 1)


# --- two trainer processes into a TP 2 engine -----------------------------------------------


class _TP2Server:
    """SGLang-shaped: TP rank ``i`` opens entry ``i`` of ``serialized_named_tensors`` into its own
    module; ``/weights_checksum`` answers rank 0's digests. Records which process made each
    entry (CPU payloads name their shared-memory file after the sender's pid)."""

    def __init__(self) -> None:
        self.ranks = [ModuleReceiver(_model(1), dtype=torch.bfloat16) for _ in range(2)]
        self.senders: list[list[int]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._send({"dtype": "bfloat16", "tp_size": 2})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/weights_checksum":
                    return self._send(outer.ranks[0].weights_checksum(body["names"]))
                entries = body["serialized_named_tensors"]
                outer.senders.append([_sender_pid(e) for e in entries])
                for rx, entry in zip(outer.ranks, entries, strict=True):
                    named = deserialize_named_tensors(entry, load_format=body["load_format"])
                    rx.update_weights_from_tensor(named, weight_version=body["weight_version"])
                self._send({"success": True, "message": "Success"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def _sender_pid(entry: str) -> int:
    import base64

    m = re.search(rb"torch_(\d+)_", base64.b64decode(entry))
    assert m is not None
    return int(m.group(1))


def _server_process(conn: Any) -> None:
    """The engine in its own process (it holds the ranks' shared-memory manager connections)."""
    server = _TP2Server()
    conn.send(server.url)
    conn.recv()
    server.httpd.shutdown()
    digests = [
        {k: tensor_digest(v) for k, v in rx.module.state_dict().items()} for rx in server.ranks
    ]
    conn.send((server.senders, digests))


def _rank(rank: int, url: str, out: str) -> None:
    # A file rendezvous: no port to pick.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/pg",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        rx = HTTPReceiver(url) if rank == 0 else None
        sync = ColocatedSync(rx, engine_url=url if rank == 0 else None, bucket_bytes=300,
                             verify=True)  # fmt: skip
        # Every rank holds the full weights (as after the trainer's gathers).
        result = sync.sync(_trainer(_model(0), rank, 2), 3)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), **result}))
    finally:
        from miles_transfer.dist import shutdown_process_group

        shutdown_process_group()  # see miles-transfer's README, "Ending a gloo process"


@pytest.mark.timeout(180)
def test_two_trainer_ranks_each_send_their_own_payload(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    engine = ctx.Process(target=_server_process, args=(there,))
    engine.start()
    try:
        assert here.poll(120), "the engine process did not start"
        url = here.recv()
        ranks = [ctx.Process(target=_rank, args=(r, url, str(tmp_path))) for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:  # no timeout: see test_cuda_ipc.py (shared-memory manager pipes)
            p.join()
        assert [p.exitcode for p in ranks] == [0, 0]
        here.send("stop")
        assert here.poll(60), "the engine process did not answer"
        senders, digests = here.recv()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (r0["method"], r0["verified"], r0["payloads"], r0["weight_version"]) == (
        "colocated", True, 2, "3",
    )  # fmt: skip
    assert set(r1) == {"pid"}  # metrics come from rank 0
    assert len(senders) == r0["buckets"] > 1
    assert all(s == [r0["pid"], r1["pid"]] for s in senders)  # entry i from trainer rank i
    want = {k: tensor_digest(v.to(torch.bfloat16)) for k, v in _model(0).state_dict().items()}
    assert digests == [want, want]
