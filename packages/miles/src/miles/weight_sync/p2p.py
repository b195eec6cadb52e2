"""``transfer.method: p2p``: every trainer rank sends its own shard, nobody gathers.

The trainer's layout is FSDP2's (``trainer.backend: fsdp``: Shard(0) of every parameter) or a
Megatron-core job's (``megatron``: TP / PP / DP / EP shards in Megatron's names, fused QKV and
gate/up, padded vocabulary; the trainer's ``megatron_shards()`` and ``megatron_layout_args()``).
The engine is one destination rank of a replicated layout (it serves whole HF tensors). Its
receiving side (``miles_transfer.p2p.engine.EngineSink``) takes every trainer rank's shard
straight from that rank, in buckets re-sharded on the way, into staging buffers while the
engine keeps generating; it checks them bit for bit against the digests each trainer rank
computed on its own shard, then swaps them in between ``pause_generation`` and
``continue_generation`` and compares the engine's digests.

Where the receiving side runs:

- the embedded engine, one trainer process: no transport, one copy from the trainer's
  parameters into the staging buffers (``reshard_local``);
- the embedded engine, several trainer processes (torchrun): a thread of rank 0, reached over
  ``transfer.p2p.transport`` (TCP or shared memory) through a TCPStore rank 0 hosts;
- a ``miles-rollout serve`` (or SGLang-API) engine at ``rollout.engine_url``: a
  ``miles-transfer p2p-agent`` process on the engine's host. ``transfer.p2p.agent: host:port``
  names one already running there; unset, rank 0 starts one on this host. The agent swaps the
  buffers in through the engine's ``update_weights_from_tensor`` (same host: shared memory).

``sync`` returns (``update/*``): ``bytes`` (received by the engine's side: exactly its layout's
bytes), ``sent_bytes`` (this step's bytes from rank 0's own shard), ``receive_s`` (the engine
kept generating), ``check_s``, ``pause_s`` (what the engine saw), ``verified``.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from miles.protocols import Trainer
from miles_transfer import WeightReceiver
from miles_transfer.p2p import (
    module_param_specs,
    module_shards,
    plan_transfer,
    reshard_local,
    tied_names,
)
from miles_transfer.p2p.engine import (
    EngineSink,
    SourceEndpoint,
    fsdp_source,
    megatron_source,
    setup_message,
    source_layout,
    swap_into_engine,
)
from miles_transfer.p2p.layouts import ModelShape, ParamSpec, replicated_layout
from miles_transfer.push import HTTPReceiver

__all__ = ["P2PSync"]

_READY = re.compile(r"p2p-agent ready at (\S+):(\d+)")


def _broadcast(obj: Any, world: int) -> Any:
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _store(host: str, port: int, *, master: bool = False) -> Any:
    from datetime import timedelta

    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=master, wait_for_workers=False, timeout=timedelta(seconds=300)
    )


class P2PSync:
    """Re-sharded P2P from the trainer's shards into the engine (see the module docstring).

    Args:
        receiver: rank 0's engine (the embedded ``Engine`` or an ``HTTPReceiver``); ``None``
            on other ranks.
        engine_url: the engine's URL when it is a server (``rollout.engine_url``).
        transport: ``"tcp"`` or ``"shm"`` between trainer ranks and the engine's side.
        host: the address this host listens on.
        agent: ``"host:port"`` of a running ``miles-transfer p2p-agent``; ``None`` starts one
            (server engines only).
        bucket_bytes: the most bytes one message carries.
        verify: check bit for bit after each update.
    """

    def __init__(
        self,
        receiver: WeightReceiver | None,
        *,
        engine_url: str | None,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        agent: str | None = None,
        bucket_bytes: int = 64 << 20,
        verify: bool = True,
        api_key: str | None = None,
    ) -> None:
        self.receiver = receiver
        self.engine_url = engine_url
        # Proven on every mesh connection, signing the rendezvous; the agent gets it too.
        self.api_key = api_key
        self.transport = transport
        self.host = host
        self.agent = agent
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self._names: list[str] | None = None
        self._dtype: torch.dtype | None = None
        self._endpoint: SourceEndpoint | None = None
        self._local: tuple[Any, dict[str, torch.Tensor]] | None = None  # (plan, buffers)
        self._sink_thread: threading.Thread | None = None
        self._sink: EngineSink | None = None
        self._agent_proc: subprocess.Popen[str] | None = None
        self._closed = False

    # ------------------------------------------------------------------ setup (first sync)

    def _source(self, trainer: Trainer, world: int) -> dict[str, Any]:
        """The trainer's layout description in the engine's dtype, and what this rank sends."""
        assert self._dtype is not None
        if callable(getattr(trainer, "megatron_shards", None)):  # the Megatron backend
            shape = ModelShape.from_hf_config(trainer.hf_config, dtype=self._dtype)  # type: ignore[attr-defined]
            return megatron_source(shape, **trainer.megatron_layout_args())  # type: ignore[attr-defined]
        model = getattr(trainer, "model", None)
        if model is None:
            raise TypeError(f"{type(trainer).__name__} has no .model to send shards from")
        specs = module_param_specs(model)
        tied = tied_names(model)
        params = {
            n: ParamSpec(s.shape, self._dtype if s.dtype.is_floating_point else s.dtype)
            for n, s in specs.items()
            if n not in tied
        }
        return fsdp_source(params, world)

    def _shards(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """This rank's local tensors named as in its layout rank, cast to the engine's dtype."""
        assert self._dtype is not None
        assert self._names is not None
        get = getattr(trainer, "megatron_shards", None)
        local = get() if callable(get) else module_shards(trainer.model)  # type: ignore[attr-defined]
        missing = [n for n in self._names if n not in local]
        if missing:
            raise ValueError(f"the trainer's shards lack {missing[:5]} of its P2P layout")
        dt = self._dtype
        return {
            n: local[n].to(dt) if local[n].is_floating_point() else local[n] for n in self._names
        }

    def _setup(self, trainer: Trainer, rank: int, world: int) -> None:
        addr: tuple[str, int] | None = None
        embedded = self.receiver is not None and not isinstance(self.receiver, HTTPReceiver)
        if rank == 0:
            assert self.receiver is not None
            self._dtype = self.receiver.dtype
            if self.engine_url is not None and not isinstance(self.receiver, HTTPReceiver):
                raise ValueError("transfer.method p2p: rollout.engine_url needs an HTTP engine")
            if self.engine_url is not None:
                addr = self._agent_address()
            elif world > 1:
                store = _store(self.host, 0, master=True)
                addr = (self.host, int(store.port))
                self._master_store = store
        dtype_name, addr, embedded = _broadcast(
            (str(self._dtype).removeprefix("torch."), addr, embedded), world
        )
        self._dtype = getattr(torch, dtype_name)
        src = self._source(trainer, world)
        src_layout = source_layout(src)
        self._names = [n for n, _ in src_layout.rank(rank).tensors]
        if embedded and world == 1:
            dst = replicated_layout(src_layout.param_specs(), 1)
            self._local = (plan_transfer(src_layout, dst), dst.rank(0).allocate())
            return
        setup = setup_message(
            src, bucket_bytes=self.bucket_bytes, transport=self.transport, verify=self.verify
        )
        assert addr is not None
        store = self._master_store if rank == 0 and embedded else _store(*addr)
        if rank == 0 and embedded:
            self._sink = EngineSink(
                self.receiver, store, json.loads(setup), host=self.host, api_key=self.api_key
            )
            self._sink_thread = threading.Thread(
                target=self._sink.serve, name="p2p-engine-sink", daemon=True
            )
            self._sink_thread.start()
        alive = self._agent_alive if self._agent_proc is not None else None
        self._endpoint = SourceEndpoint(
            store, rank, setup, host=self.host, alive=alive, api_key=self.api_key
        )
        if rank == 0:
            atexit.register(self.close)

    def _agent_address(self) -> tuple[str, int]:
        if self.agent is not None:
            host, _, port = self.agent.rpartition(":")
            return host, int(port)
        assert self.engine_url is not None
        cmd = [
            sys.executable,
            "-m",
            "miles_transfer.cli",
            "p2p-agent",
            "--engine-url",
            self.engine_url,
            "--host",
            self.host,
            "--parent-pid",
            str(os.getpid()),
        ]
        env = {k: v for k, v in os.environ.items() if k != "MILES_API_KEY"}
        if self.api_key is not None:
            env["MILES_API_KEY"] = self.api_key  # not on a command line that ps shows
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self._agent_proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the agent prints its address (or exits)
        m = _READY.search(line)
        if m is None:
            proc.wait(timeout=30)
            raise RuntimeError(
                f"miles-transfer p2p-agent did not start (exit code {proc.returncode}): {line!r}"
            )
        return m.group(1), int(m.group(2))

    def _agent_alive(self) -> bool:
        return self._agent_proc is not None and self._agent_proc.poll() is None

    # ------------------------------------------------------------------ per step

    def sync(self, trainer: Trainer, version: int) -> dict[str, Any]:
        """Send every rank's shard to the engine and swap it in (every rank calls this)."""
        if self._names is None:
            self._setup(trainer, trainer.rank, trainer.world_size)
        shards = self._shards(trainer)
        if self._local is not None:
            return self._sync_local(shards, version)
        assert self._endpoint is not None
        t0 = time.perf_counter()
        rep = self._endpoint.send(shards, str(version))
        if rep is None:
            return {}
        return {
            "weight_version": rep.weight_version,
            "method": "p2p",
            "bytes": rep.bytes,
            "sent_bytes": self._endpoint.sent_bytes,
            "receive_s": rep.receive_s,
            "check_s": rep.check_s,
            "pause_s": rep.pause_s,
            "send_s": time.perf_counter() - t0,
            "verified": rep.verified,
        }

    def _sync_local(self, shards: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        assert self._local is not None
        assert self.receiver is not None
        plan, buffers = self._local
        t0 = time.perf_counter()
        moved = reshard_local(plan, {0: shards}, {0: buffers})
        receive_s = time.perf_counter() - t0
        pause_s = swap_into_engine(self.receiver, buffers, str(version), verify=self.verify)
        return {
            "weight_version": str(version),
            "method": "p2p",
            "bytes": moved,
            "sent_bytes": moved,
            "receive_s": receive_s,
            "check_s": 0.0,
            "pause_s": pause_s,
            "send_s": time.perf_counter() - t0,
            "verified": self.verify,
        }

    def close(self) -> None:
        """Stop the engine's side (thread or agent process) and release sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._endpoint is not None:
            try:
                self._endpoint.stop()
            finally:
                self._endpoint.close()
        if self._sink_thread is not None:
            self._sink_thread.join(timeout=30)
        if self._sink is not None:
            self._sink.close()
        if self._agent_proc is not None:
            try:
                self._agent_proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._agent_proc.terminate()
                self._agent_proc.wait(timeout=30)
