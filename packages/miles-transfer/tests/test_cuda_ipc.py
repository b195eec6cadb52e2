"""CUDA IPC payloads and the colocated receiver: what runs on CPU, plus GPU tests (marked).

On CPU: argument checks, torch's handle layout, parsing payloads of SGLang's shape, the missing
``cuda-python`` ImportError, that importing touches no CUDA, and ``ColocatedReceiver`` end to
end with CPU tensors (one shared-memory payload per TP rank) into an SGLang-shaped server,
in one process and across two gloo processes. The CUDA path itself: ``@pytest.mark.gpu`` here
and ``tools/gpu_checks/transfer_cuda_ipc_check.py``.
"""

from __future__ import annotations

import base64
import datetime
import gc
import glob
import io
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_transfer import ModuleReceiver, push_weights, tensor_digest
from miles_transfer.push import ReceiverError, deserialize_named_tensors
from miles_transfer.push.colocated import ColocatedReceiver, SingleProcessGroup, TorchDistGroup
from miles_transfer.push.cuda_ipc import (
    _IPCPickler,
    _torch_rebuild_cuda_tensor,
    _with_version,
    describe_cuda_ipc,
    parse_torch_handle,
    serialize_cuda_ipc,
)
from miles_transfer.push.wire import FlattenedTensorMetadata, serialize_named_tensors

CUDA_HANDLE = bytes(range(64))


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


# --- arguments and formats ---------------------------------------------------------------------


def test_cpu_tensors_and_bad_arguments_are_refused():
    cpu = [("w", torch.ones(4))]
    with pytest.raises(ValueError, match="serialize_named_tensors"):
        serialize_cuda_ipc(cpu)
    with pytest.raises(ValueError, match="at least one tensor"):
        serialize_cuda_ipc([])
    with pytest.raises(ValueError, match="load_format"):
        serialize_cuda_ipc(cpu, load_format="miles_safetensors")
    with pytest.raises(ValueError, match="device_ref"):
        serialize_cuda_ipc(cpu, device_ref="name")
    with pytest.raises(ValueError, match="handle_version"):
        serialize_cuda_ipc(cpu, handle_version=300)


def test_torch_handle_layouts():
    versioned = bytes([3]) + b"c" + CUDA_HANDLE
    h = parse_torch_handle(versioned)
    assert (h.version, h.kind, h.cuda_handle) == (3, "c", CUDA_HANDLE)
    assert parse_torch_handle(CUDA_HANDLE).version is None  # pre-versioning torch
    assert parse_torch_handle(bytes([3]) + b"e" + b"x" * 40).kind == "e"
    with pytest.raises(ValueError, match="unknown CUDA storage handle"):
        parse_torch_handle(b"\x03z" + CUDA_HANDLE)
    # handle_version rewrites only the version byte of a cudaMalloc handle.
    assert _with_version(versioned, 2) == bytes([2]) + versioned[1:]
    with pytest.raises(ValueError, match="expandable_segments:False"):
        _with_version(bytes([3]) + b"e" + b"x" * 40, 2)
    with pytest.raises(ValueError, match="unversioned"):
        _with_version(CUDA_HANDLE, 2)


class _CudaLike:
    """Reduces like torch's reduce_tensor does for a CUDA tensor (15 rebuild arguments), so a
    payload of SGLang's shape can be parsed here without a GPU."""

    def __init__(self, numel: int, dtype: torch.dtype, *, offset: int, rebuild: object) -> None:
        self.args = (
            torch.Tensor, torch.Size([numel]), (1,), offset, torch.storage.TypedStorage, dtype,
            "GPU-uuid", bytes([3]) + b"c" + CUDA_HANDLE, 1 << 20, 4096, False,
            "/torch_ref_counter", 0, b"\x07" * 64, True,
        )  # fmt: skip
        self.rebuild = rebuild

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.rebuild, self.args


def _sglang_named(*args: object) -> None:
    """Stands in for SGLang's patched rebuild (pickled under SGLang's module path below)."""


_sglang_named.__module__ = "sglang.srt.utils.patch_torch"
_sglang_named.__qualname__ = _sglang_named.__name__ = "_rebuild_cuda_tensor_modified"


class _SGLangNamesPickler(_IPCPickler):
    def save_global(self, obj, name=None):
        if obj is _sglang_named:
            self.write(b"csglang.srt.utils.patch_torch\n_rebuild_cuda_tensor_modified\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


@pytest.mark.parametrize("sglang_name", [False, True])
def test_describe_parses_sglang_shaped_flattened_payloads(sglang_name):
    rebuild = _sglang_named if sglang_name else _torch_rebuild_cuda_tensor()
    flat = _CudaLike(96, torch.bfloat16, offset=8, rebuild=rebuild)
    meta = [
        FlattenedTensorMetadata("a", torch.Size([4, 8]), torch.bfloat16, 0, 32, 32),
        FlattenedTensorMetadata("b", torch.Size([64]), torch.bfloat16, 32, 96, 64),
    ]
    buf = io.BytesIO()
    pickler_cls = _SGLangNamesPickler if sglang_name else _IPCPickler
    pickler_cls(buf, uuid=None, handle_version=None).dump(
        {"flattened_tensor": flat, "metadata": meta}
    )
    text = base64.b64encode(buf.getvalue()).decode()
    module = b"sglang.srt.utils.patch_torch" if sglang_name else b"torch.multiprocessing"
    assert module in buf.getvalue()
    a, b = describe_cuda_ipc(text, load_format="flattened_bucket")
    # bytes from the allocation base: storage offset + (tensor offset + start) * itemsize
    assert (a.name, a.shape, a.dtype, a.offset_bytes, a.nbytes) == (
        "a",
        (4, 8),
        torch.bfloat16,
        4096 + 8 * 2,
        64,
    )
    assert (b.offset_bytes, b.nbytes) == (4096 + (8 + 32) * 2, 128)
    assert a.ref.device == "GPU-uuid"
    assert parse_torch_handle(a.ref.handle).cuda_handle == CUDA_HANDLE
    assert a.ref.event_sync_required
    assert a.ref.event_handle == b"\x07" * 64
    with pytest.raises(ValueError, match="list of"):
        describe_cuda_ipc(text, load_format=None)


def test_describe_refuses_cpu_payloads_without_opening_them(no_shm_leak):
    text = serialize_named_tensors([("w", torch.ones(8))], load_format="flattened_bucket")
    with pytest.raises(ValueError, match="not a CUDA IPC rebuild"):
        describe_cuda_ipc(text, load_format="flattened_bucket")
    # The shared-memory reference was not consumed: it reads (and is released) normally.
    assert torch.equal(deserialize_named_tensors(text, load_format="flattened_bucket")[0][1],
                       torch.ones(8))  # fmt: skip


# --- no CUDA at import, the cuda-python extra ---------------------------------------------------


def test_importing_initialises_no_cuda_and_imports_no_cuda_python():
    # torch itself may import cuda.bindings when cuda-python is installed (torch 2.13 does):
    # what counts is that our modules add none and initialise nothing.
    code = (
        "import sys, torch\n"
        "cuda = lambda: {m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')}\n"
        "before = cuda()\n"
        "import miles_transfer, miles_transfer.push, miles_transfer.push.cuda_ipc\n"
        "import miles_transfer.push.colocated, miles_transfer.push.cuda_runtime\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert cuda() == before, sorted(cuda() - before)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_missing_cuda_python_names_the_extra(monkeypatch):
    from miles_transfer.push import cuda_runtime

    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'miles-transfer\[cuda\]'"):
        cuda_runtime.runtime()
    with pytest.raises(ImportError, match=r"miles-transfer\[cuda\]"):
        cuda_runtime.device_uuid(0)
    # check_handles=True asks for it before connecting to anything.
    with pytest.raises(ImportError, match=r"miles-transfer\[cuda\]"):
        ColocatedReceiver("http://127.0.0.1:9", dtype=torch.bfloat16, check_handles=True)


# --- ColocatedReceiver on CPU -------------------------------------------------------------------


class TPServer:
    """SGLang-shaped: TP rank ``i`` opens entry ``i`` of ``serialized_named_tensors`` into its own
    module, as SGLang's TP workers do; ``/weights_checksum`` answers rank 0's digests."""

    def __init__(self, tp_size: int) -> None:
        self.ranks = [ModuleReceiver(_model(1), dtype=torch.bfloat16) for _ in range(tp_size)]
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._send(200, {"dtype": "bfloat16", "tp_size": tp_size})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/weights_checksum":
                    return self._send(200, outer.ranks[0].weights_checksum(body["names"]))
                outer.bodies.append(body)
                for rank, rx in enumerate(outer.ranks):
                    entry = body["serialized_named_tensors"][rank]
                    named = deserialize_named_tensors(entry, load_format=body["load_format"])
                    rx.update_weights_from_tensor(named, weight_version=body["weight_version"])
                    del named
                self._send(200, {"success": True, "message": "Success"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _state_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_colocated_push_single_process(load_format, no_shm_leak):
    server = TPServer(tp_size=1)
    try:
        rx = ColocatedReceiver(server.url, dtype="bfloat16", load_format=load_format)
        src = _model(0)
        report = push_weights(src.state_dict().items(), rx, weight_version="2", bucket_bytes=300)
        assert report.verified
        assert report.buckets == len(server.bodies) > 1
        body = server.bodies[-1]
        assert (body["load_format"], body["weight_version"]) == (load_format, "2")
        assert len(body["serialized_named_tensors"]) == 1
        got = server.ranks[0].module.state_dict()
        for name, t in _state_bf16(src).items():
            assert tensor_digest(got[name]) == tensor_digest(t), name
    finally:
        server.close()


def test_colocated_group_must_match_the_engine(no_shm_leak):
    server = TPServer(tp_size=2)
    try:
        with pytest.raises(ValueError, match="tp_size=2 but the colocated group has 1"):
            ColocatedReceiver(server.url, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="needs the engine's base_url"):
            ColocatedReceiver(None, dtype=torch.bfloat16, group=SingleProcessGroup())
        with pytest.raises(ValueError, match="load_format"):
            ColocatedReceiver(server.url, dtype=torch.bfloat16, load_format="miles_safetensors")
    finally:
        server.close()
    with socket.socket() as s:  # bound, never listening: refuses for as long as the block runs
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ReceiverError):
            ColocatedReceiver(dead, dtype=torch.bfloat16)


def _colocated_rank(rank: int, url: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/pg",  # file rendezvous: no port to pick
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        rx = ColocatedReceiver(url if rank == 0 else None, dtype="bfloat16", group=TorchDistGroup())
        # Every rank holds the full weights (as after the trainer's gather) and sends its copy.
        report = push_weights(_model(0).state_dict().items(), rx, weight_version="5",
                              bucket_bytes=300)  # fmt: skip
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"pid": os.getpid(), "verified": report.verified})
        )
    finally:
        from miles_transfer.dist import shutdown_process_group

        shutdown_process_group()


def _tp_server_process(tp_size: int, conn: Any) -> None:
    """The engine in its own process: url out, then on "stop" every body's entries and every TP
    rank's digests back. Its own process because it is the one holding the connections to the
    trainer ranks' torch_shm_manager processes (torch never closes them): when it exits, they do.
    """
    server = TPServer(tp_size)
    conn.send(server.url)
    conn.recv()
    server.close()
    entries = [body["serialized_named_tensors"] for body in server.bodies]
    digests = [
        {k: tensor_digest(v) for k, v in rx.module.state_dict().items()} for rx in server.ranks
    ]
    conn.send((entries, digests))


@pytest.mark.timeout(180)
def test_colocated_push_two_trainer_ranks_into_tp2(tmp_path):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    engine = ctx.Process(target=_tp_server_process, args=(2, there))
    engine.start()
    ranks = []
    try:
        assert here.poll(120), "the engine process did not start"
        url = here.recv()
        ranks = [ctx.Process(target=_colocated_rank, args=(r, url, str(tmp_path)))
                 for r in range(2)]  # fmt: skip
        for p in ranks:
            p.start()
        # join() without a timeout waits on the pid: the ranks' torch_shm_manager children hold
        # the sentinel pipes that a timed join waits on, until the engine process lets go.
        for p in ranks:
            p.join()
        assert [p.exitcode for p in ranks] == [0, 0]
        here.send("stop")
        assert here.poll(60), "the engine process did not answer"
        entries, digests = here.recv()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    pids = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(p["verified"] for p in pids)
    assert len(entries) > 1
    for body_entries in entries:
        assert len(body_entries) == 2
        # Entry i is rank i's own shared-memory file (named after its process).
        for rank, entry in enumerate(body_entries):
            assert f"torch_{pids[rank]['pid']}_".encode() in base64.b64decode(entry)
    want = {k: tensor_digest(v) for k, v in _state_bf16(_model(0)).items()}
    assert digests == [want, want]


# --- on a GPU ------------------------------------------------------------------------------------


def _child_raw(payload: str, load_format: str | None) -> dict[str, str]:
    """In a fresh process: read every span through its raw handle with cuda-python."""
    from miles_transfer.push.cuda_runtime import read_span

    raw = {}
    for span in describe_cuda_ipc(payload, load_format=load_format):
        data = torch.frombuffer(bytearray(read_span(span)), dtype=torch.uint8)
        raw[span.name] = tensor_digest(data.view(span.dtype).reshape(span.shape))
    return raw


def _child_torch(payload: str, load_format: str | None) -> dict[str, str]:
    """In a fresh process: open the payload as SGLang does (torch's rebuild, device by UUID)."""
    from miles_transfer.push.cuda_ipc import open_cuda_ipc

    return {n: tensor_digest(t.cpu()) for n, t in open_cuda_ipc(payload, load_format=load_format)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_cuda_ipc_round_trip_in_another_process(load_format):
    pytest.importorskip("cuda.bindings")
    from miles_transfer.push.cuda_runtime import check_payload

    g = torch.Generator().manual_seed(0)
    named = [
        ("bf16", torch.randint(-(2**15), 2**15, (33, 7), generator=g, dtype=torch.int16)
         .view(torch.bfloat16)),
        ("f32", torch.randn(5, 3, generator=g)),
        ("i64", torch.arange(11)),
    ]  # fmt: skip
    want = {n: tensor_digest(t) for n, t in named}
    payload = serialize_cuda_ipc([(n, t.cuda()) for n, t in named], load_format=load_format)
    check_payload(payload)
    # One process per reader: a process maps a given IPC handle once.
    ctx = mp.get_context("spawn")
    for reader in (_child_raw, _child_torch):
        with ctx.Pool(1) as pool:
            assert pool.apply(reader, (payload.text, load_format)) == want, reader.__name__
