"""HTTPReceiver against real HTTP servers on loopback (no leaks in /dev/shm, clear errors)."""

from __future__ import annotations

import gc
import glob
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from miles_transfer import HTTPReceiver, ModuleReceiver, push_weights, tensor_digest
from miles_transfer.checkpoint import save_safetensors
from miles_transfer.push import (
    ReceiverError,
    WeightMismatchError,
    WeightServer,
    deserialize_named_tensors,
    iter_full_state,
)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _shm_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


@pytest.fixture
def no_shm_leak():
    gc.collect()
    before = _shm_files()
    yield
    gc.collect()
    assert _shm_files() - before == set(), "shared-memory files left behind"


class StockLikeServer:
    """A stock-SGLang-shaped server written with http.server: TP ranks, no /weights_checksum.

    Rank ``i`` reads entry ``i`` of ``serialized_named_tensors`` into its own ModuleReceiver,
    as SGLang's TP workers do. Every request body is recorded.
    """

    def __init__(self, tp_size: int, dtype: str = "bfloat16", fail_update_with: int = 0) -> None:
        self.ranks = [ModuleReceiver(_model(1), dtype=torch.bfloat16) for _ in range(tp_size)]
        self.requests: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/get_server_info":
                    self._send(200, {"dtype": dtype, "tp_size": tp_size, "model_path": "/m"})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if self.path == "/update_weights_from_tensor":
                    if fail_update_with:
                        self._send(fail_update_with, {"detail": "rejected"})
                        return
                    payloads = body["serialized_named_tensors"]
                    for rank, rx in enumerate(outer.ranks):
                        named = deserialize_named_tensors(
                            payloads[rank], load_format=body["load_format"]
                        )
                        rx.update_weights_from_tensor(named, weight_version=body["weight_version"])
                        del named
                    self._send(200, {"success": True, "message": "Success"})
                elif self.path in ("/pause_generation", "/continue_generation"):
                    self._send(200, {})
                elif self.path == "/update_weights_from_disk":
                    self._send(200, {"success": True, "message": "ok", "num_paused_requests": 0})
                else:
                    self._send(404, {"detail": "Not Found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stock_server():
    servers: list[StockLikeServer] = []

    def make(**kw) -> StockLikeServer:
        servers.append(StockLikeServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_sglang_shaped_requests_reach_every_tp_rank(stock_server, load_format, no_shm_leak):
    server = stock_server(tp_size=2)
    rx = HTTPReceiver(server.url, load_format=load_format)
    assert (rx.dtype, rx.tp_size) == (torch.bfloat16, 2)
    src = _model(0)
    with rx.paused(mode="in_place"):
        report = push_weights(
            iter_full_state(src), rx, weight_version="3", bucket_bytes=256, verify=False
        )
    paths = [p for p, _ in server.requests]
    assert paths[0] == "/pause_generation"
    assert paths[-1] == "/continue_generation"
    assert server.requests[0][1] == {"mode": "in_place"}
    updates = [b for p, b in server.requests if p == "/update_weights_from_tensor"]
    assert len(updates) == report.buckets > 1
    for i, body in enumerate(updates):
        assert len(body["serialized_named_tensors"]) == 2
        assert body["load_format"] == load_format
        assert body["weight_version"] == ("3" if i == len(updates) - 1 else None)
        assert body["flush_cache"] is (i == len(updates) - 1)
    want = {n: tensor_digest(t.to(torch.bfloat16)) for n, t in src.state_dict().items()}
    for rank in server.ranks:
        assert rank.weights_checksum() == want
        assert rank.weight_version == "3"


def test_stock_sglang_without_checksum_endpoint_gives_a_clear_error(stock_server, no_shm_leak):
    rx = HTTPReceiver(stock_server(tp_size=1).url)
    with pytest.raises(ReceiverError, match=r"verify=False"):
        push_weights(iter_full_state(_model(0)), rx, weight_version="1")


@pytest.mark.parametrize("status", [404, 422, 500])
def test_rejected_update_releases_shared_memory(stock_server, status, no_shm_leak):
    rx = HTTPReceiver(stock_server(tp_size=2, fail_update_with=status).url)
    with pytest.raises(ReceiverError, match=f"HTTP {status}"):
        rx.update_weights_from_tensor(list(iter_full_state(_model(0), dtype=torch.bfloat16)))


def test_unreachable_server_raises_and_releases_shared_memory(no_shm_leak):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # held, not listening: refused, and nobody else can take it
        port = s.getsockname()[1]
        rx = HTTPReceiver(f"http://127.0.0.1:{port}", dtype=torch.float32, tp_size=1)
        with pytest.raises(ReceiverError, match="failed"):
            rx.update_weights_from_tensor(list(iter_full_state(_model(0))))
        with pytest.raises(ReceiverError):
            HTTPReceiver(f"http://127.0.0.1:{port}")


def test_dtype_auto_needs_an_explicit_dtype(stock_server):
    server = stock_server(tp_size=1, dtype="auto")
    with pytest.raises(ValueError, match="pass dtype="):
        HTTPReceiver(server.url)
    assert HTTPReceiver(server.url, dtype="float16").dtype == torch.float16
    with pytest.raises(ValueError, match="http://"):
        HTTPReceiver("127.0.0.1:1")


def test_miles_weight_server_round_trip_with_verification(no_shm_leak):
    src = _model(0)
    with WeightServer(ModuleReceiver(_model(1), dtype=torch.bfloat16)) as server:
        rx = HTTPReceiver(server.url)
        for step in range(1, 4):
            with torch.no_grad():
                src[0].weight.add_(0.01 * step)
            with rx.paused():
                report = push_weights(
                    iter_full_state(src), rx, weight_version=str(step), bucket_bytes=512
                )
            assert report.verified
        assert server.pause_calls == ["retract"] * 3
        assert not server.paused
        assert server.receiver.weight_version == "3"
        assert rx.weights_checksum() == {
            n: tensor_digest(t.to(torch.bfloat16)) for n, t in src.state_dict().items()
        }


def test_weight_server_rejects_bad_updates_whole(no_shm_leak):
    with WeightServer(ModuleReceiver(_model(1))) as server:
        rx = HTTPReceiver(server.url)
        before = rx.weights_checksum()
        good = list(iter_full_state(_model(0)))
        with pytest.raises(ReceiverError, match="no such parameter"):
            rx.update_weights_from_tensor(
                [*good, ("extra.weight", torch.zeros(2))], weight_version="9"
            )
        assert rx.weights_checksum() == before
        assert server.receiver.weight_version == "0"
        with pytest.raises(ReceiverError, match="unknown weight names"):
            rx.weights_checksum(["nope"])


def test_corruption_on_the_server_is_detected_over_http(no_shm_leak):
    class Corrupting(ModuleReceiver):
        def update_weights_from_tensor(self, named_tensors, **kw):
            super().update_weights_from_tensor(named_tensors, **kw)
            with torch.no_grad():
                self.module[2].bias.view(torch.int32)[0] ^= 1

    with (
        WeightServer(Corrupting(_model(1))) as server,
        pytest.raises(WeightMismatchError, match=r"2\.bias"),
    ):
        push_weights(iter_full_state(_model(0)), HTTPReceiver(server.url), weight_version="1")


def test_update_weights_from_disk(tmp_path):
    src = _model(0)
    save_safetensors(src.state_dict().items(), tmp_path / "model.safetensors")
    with WeightServer(ModuleReceiver(_model(1))) as server:
        rx = HTTPReceiver(server.url)
        out = rx.update_weights_from_disk(str(tmp_path), weight_version="12")
        assert out["success"] is True
        assert server.receiver.weight_version == "12"
        assert rx.weights_checksum() == {n: tensor_digest(t) for n, t in src.state_dict().items()}
        with pytest.raises(ReceiverError, match="no such file"):
            rx.update_weights_from_disk(str(tmp_path / "missing"))


def test_update_weights_from_disk_request_shape(stock_server):
    server = stock_server(tp_size=1)
    HTTPReceiver(server.url).update_weights_from_disk(
        "/ckpt/step_3", weight_version="3", abort_all_requests=True
    )
    assert server.requests[-1] == (
        "/update_weights_from_disk",
        {
            "model_path": "/ckpt/step_3",
            "load_format": None,
            "abort_all_requests": True,
            "weight_version": "3",
            "flush_cache": True,
        },
    )
