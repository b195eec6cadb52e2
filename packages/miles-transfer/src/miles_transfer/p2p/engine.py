"""P2P into whole engines: trainer ranks send their shards, the engine's host receives them.

An engine that serves whole HF tensors (a TP 1 engine: the embedded miles-rollout engine, a
``miles-rollout serve`` process, an SGLang server behind its HTTP API) is one destination rank
of a replicated layout. Its receiving side, an ``EngineSink``, runs on the engine's host: in the
trainer's process for an in-process engine, or in a ``miles-transfer p2p-agent`` process beside
a server (``run_agent``). It receives every trainer rank's shard over a transport (TCP or shared
memory) into staging buffers in the engine's layout while the engine keeps generating, checks
them, then swaps them in with one ``update_weights_from_tensor`` between ``pause_generation``
and ``continue_generation``. The trainer's layout is FSDP2's (``fsdp_source``) or a
Megatron-core job's (``megatron_source``: TP / PP / DP / EP shards, fused QKV, padded
vocabulary); the plan re-shards either into whole HF tensors on the way.

Trainer ranks and the sink meet in a ``torch.distributed`` Store (a TCPStore: torch only) under
a key prefix. The trainer's rank 0 writes the setup once (``setup_message``: the source layout,
dtype, bucket size, transport); each update ``n`` (1, 2, ...) is announced under ``update/n``,
every source rank writes the digests of its shards under ``digests/n/<rank>`` (verification),
and the sink answers under ``done/n`` (bytes, timings, verification, or the error). Group
ranks: trainer ranks ``0..S-1``, the sink ``S``.

Verification is bit for bit in two hops: every trainer rank hashes each HF box its local
tensors hold (``piece_digests``: padding left out), the sink hashes the same boxes of what it
received and compares; then the engine's per-tensor digests (``weights_checksum``) are
compared with the staging buffers'. Together: the engine holds the trainer's weights exactly,
with no rank ever holding the full model on the trainer side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from miles_transfer.auth import check_bind
from miles_transfer.digest import tensor_digest
from miles_transfer.p2p.layouts import (
    Layout,
    ModelShape,
    ParamSpec,
    RankLayout,
    fsdp_layout,
    megatron_layout,
    replicated_layout,
)
from miles_transfer.p2p.layouts.base import local_box
from miles_transfer.p2p.plan import TransferPlan, plan_transfer
from miles_transfer.p2p.transfer import ShardReceiver, ShardSender
from miles_transfer.p2p.transports import ShmTransport, TcpTransport
from miles_transfer.p2p.transports.auth import SignedStore
from miles_transfer.protocols import Store, Transport
from miles_transfer.push.http import HTTPReceiver
from miles_transfer.push.push import WeightMismatchError, push_weights
from miles_transfer.push.wire import discard_serialized, serialize_named_tensors

__all__ = [
    "EngineSink",
    "SinkReport",
    "SourceEndpoint",
    "fsdp_source",
    "megatron_source",
    "piece_digests",
    "run_agent",
    "setup_message",
    "source_layout",
    "swap_into_engine",
]

TRANSPORTS = ("tcp", "shm")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}
_POLL_S = 0.2


def fsdp_source(params: Mapping[str, ParamSpec], world_size: int) -> dict[str, Any]:
    """The source description of FSDP2 (``fully_shard``, Shard(0)) over ``world_size`` ranks;
    ``params`` in the engine's dtype (the sources cast their shards before sending)."""
    return {
        "kind": "fsdp",
        "world_size": world_size,
        "params": {
            n: [list(s.shape), str(s.dtype).removeprefix("torch.")] for n, s in params.items()
        },
    }


def megatron_source(shape: ModelShape, **layout_args: int) -> dict[str, Any]:
    """The source description of a Megatron-core job: ``megatron_layout(shape, **layout_args)``
    (``tp``, ``pp``, ``dp``, ``ep``, ``etp``); ``shape.dtype`` is the engine's dtype."""
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    fields["dtype"] = str(shape.dtype).removeprefix("torch.")
    return {"kind": "megatron", "shape": fields, "args": dict(layout_args)}


def source_layout(src: Mapping[str, Any]) -> Layout:
    """The trainer's layout from its description (``fsdp_source`` / ``megatron_source``)."""
    if src["kind"] == "fsdp":
        params = {
            n: ParamSpec(tuple(shape), _DTYPES[dt]) for n, (shape, dt) in src["params"].items()
        }
        return fsdp_layout(params, int(src["world_size"]))
    if src["kind"] == "megatron":
        fields = dict(src["shape"])
        fields["dtype"] = _DTYPES[fields["dtype"]]
        return megatron_layout(ModelShape(**fields), **src["args"])
    raise ValueError(f"unknown source layout kind {src['kind']!r}")


def setup_message(
    src: Mapping[str, Any],
    *,
    bucket_bytes: int,
    transport: str = "tcp",
    verify: bool = True,
) -> str:
    """The setup the trainer's rank 0 writes: its layout (``fsdp_source`` or
    ``megatron_source``), the bucket size, the transport and whether to verify."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}")
    return json.dumps(
        {"src": src, "bucket_bytes": bucket_bytes, "transport": transport, "verify": verify}
    )


def _layouts(setup: Mapping[str, Any]) -> tuple[Layout, Layout]:
    src = source_layout(setup["src"])
    return src, replicated_layout(src.param_specs(), 1)


def piece_digests(rank: RankLayout, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Digests of every HF box a rank's local tensors hold (padding left out), keyed
    ``"<local name>#<piece index>"``: what a trainer rank vouches for."""
    out = {}
    for local, lt in rank.tensors:
        t = tensors[local]
        for i, p in enumerate(lt.pieces):
            if p.numel:
                box = local_box(t, p.local_start, p.local_size()).reshape(p.size)
                out[f"{local}#{i}"] = tensor_digest(box)
    return out


def _full_digests(rank: RankLayout, full: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The same digests, of the same boxes cut from full HF tensors (the engine's side)."""
    out = {}
    for local, lt in rank.tensors:
        for i, p in enumerate(lt.pieces):
            if p.numel:
                out[f"{local}#{i}"] = tensor_digest(local_box(full[p.name], p.full_start, p.size))
    return out


def _transport(
    kind: str, store: Store, rank: int, host: str, prefix: str, api_key: str | None
) -> Transport:
    cls = ShmTransport if kind == "shm" else TcpTransport
    return cls(store, rank, host=host, prefix=f"{prefix}/mesh", api_key=api_key)


def _signed(store: Store, api_key: str | None) -> Store:
    """With a key, every Store value this side writes is signed and every one it reads checked."""
    if api_key is None or isinstance(store, SignedStore):
        return store
    return SignedStore(store, api_key)


def _wait(store: Any, key: str, alive: Callable[[], bool] | None = None) -> bytes:
    """``store.get(key)`` once it is set.

    Polls ``check`` (a timed-out ``wait`` logs a warning from C++ each time) so that ``alive``
    can end the wait, e.g. when the other process is gone.
    """
    pause = 0.001
    while not store.check([key]):
        if alive is not None and not alive():
            raise TimeoutError(f"gave up waiting for {key!r}: the other side is gone")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)
    return bytes(store.get(key))


@dataclass(kw_only=True, slots=True)
class SinkReport:
    """What the engine's side did for one update (``done/n`` in the store).

    Attributes:
        ok: the engine serves the new weights; ``error`` says why not otherwise.
        weight_version: the version the engine serves now.
        bytes: bytes received (exactly the engine layout's bytes: nothing is moved twice).
        receive_s: from the first to the last bucket (the engine kept generating).
        check_s: the first verification hop (received == trainer shards).
        pause_s: from ``pause_generation`` to the end of ``continue_generation``.
        verified: both hops compared equal bit for bit (False when verification is off).
    """

    ok: bool = True
    error: str = ""
    weight_version: str = ""
    bytes: int = 0
    receive_s: float = 0.0
    check_s: float = 0.0
    pause_s: float = 0.0
    verified: bool = False


class EngineSink:
    """The engine's receiving side (see the module docstring).

    Args:
        engine: the engine: an in-process engine (``update_weights_from_tensor``,
            ``weights_checksum``, ``pause_generation``, ``continue_generation``) or an
            ``HTTPReceiver`` of a server on this host.
        store: the Store the trainer ranks use.
        setup: the trainer's ``setup_message`` (parsed).
        host: the address this side listens on.
        prefix: the key prefix in the store.
        pause_mode: SGLang's pause mode around the swap.
        api_key: the trainer ranks must prove it on every connection; Store values are signed
            (``transports/auth.py``). The same key as the sources'.
    """

    def __init__(
        self,
        engine: Any,
        store: Store,
        setup: Mapping[str, Any],
        *,
        host: str = "127.0.0.1",
        prefix: str = "miles-p2p",
        pause_mode: str = "in_place",
        api_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.store = store = _signed(store, api_key)
        self.prefix = prefix
        self.pause_mode = pause_mode
        self.verify = bool(setup["verify"])
        src, dst = _layouts(setup)
        self.plan: TransferPlan = plan_transfer(src, dst)
        self.sources = src.world_size
        self.transport = _transport(setup["transport"], store, self.sources, host, prefix, api_key)
        self.receiver = ShardReceiver(
            self.plan, 0, self.transport, bucket_bytes=int(setup["bucket_bytes"])
        )
        self.buffers = dst.rank(0).allocate()
        self.bucket_bytes = int(setup["bucket_bytes"])
        self._names_checked = False
        if isinstance(engine, HTTPReceiver):
            # The first shared-memory payload starts torch_shm_manager (seconds on a busy
            # host): pay it now, not inside the first pause.
            discard_serialized(serialize_named_tensors([("warm-up", torch.zeros(1))]))

    def update(self, n: int, weight_version: str) -> SinkReport:
        """Receive update ``n``, check it, swap it into the engine; never raises (see ``ok``)."""
        rep = SinkReport(weight_version=weight_version)
        try:
            t0 = time.perf_counter()
            got = self.receiver.receive(self.buffers)
            rep.bytes, rep.receive_s = got.bytes, time.perf_counter() - t0
            if self.verify:
                t0 = time.perf_counter()
                self._check_sources(n)
                rep.check_s = time.perf_counter() - t0
            rep.pause_s = self._swap(weight_version)
            rep.verified = self.verify
        except Exception as exc:  # reported to the trainer, which raises it
            rep.ok, rep.error = False, f"{type(exc).__name__}: {exc}"
        return rep

    def _check_sources(self, n: int) -> None:
        bad: list[str] = []
        for s in range(self.sources):
            rank = self.plan.src.rank(s)
            want = json.loads(_wait(self.store, f"{self.prefix}/digests/{n}/{s}"))
            got = _full_digests(rank, self.buffers)
            names = {
                f"{loc}#{i}": p.name for loc, lt in rank.tensors for i, p in enumerate(lt.pieces)
            }
            bad += [f"{names[k]} (trainer rank {s})" for k in got if want.get(k) != got[k]]
        if bad:
            raise ValueError(
                f"received bytes differ from what the trainer ranks hashed, nothing was swapped "
                f"in: {', '.join(bad[:8])}" + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            )

    def _swap(self, version: str) -> float:
        if not self._names_checked and isinstance(self.engine, HTTPReceiver):
            # A server takes the swap in several requests: one it refuses half way would leave
            # the earlier ones applied. Unknown names are refused here, before any change.
            self.engine.weights_checksum(list(self.buffers))
            self._names_checked = True
        return swap_into_engine(
            self.engine,
            self.buffers,
            version,
            pause_mode=self.pause_mode,
            verify=self.verify,
            bucket_bytes=self.bucket_bytes,
        )

    def serve(self, alive: Callable[[], bool] | None = None) -> None:
        """Answer updates ``1, 2, ...`` until the trainer writes a stop (or ``alive()`` fails)."""
        n = 1
        while True:
            msg = json.loads(_wait(self.store, f"{self.prefix}/update/{n}", alive))
            if msg.get("stop"):
                return
            rep = self.update(n, str(msg["weight_version"]))
            self.store.set(f"{self.prefix}/done/{n}", json.dumps(asdict(rep)))
            n += 1

    def close(self) -> None:
        self.transport.close()


def swap_into_engine(
    engine: Any,
    tensors: Mapping[str, torch.Tensor],
    version: str,
    *,
    pause_mode: str = "in_place",
    verify: bool = True,
    bucket_bytes: int = 64 << 20,
) -> float:
    """Swap whole tensors (HF names) into an engine between a pause and a continue.

    An ``HTTPReceiver`` gets them in buckets (``push_weights``, which also checks the server's
    digests); an in-process engine in one ``update_weights_from_tensor``, its digests checked
    after the continue.

    Returns:
        The pause in seconds.

    Raises:
        WeightMismatchError: the engine's digests differ from the tensors'.
    """
    items = list(tensors.items())
    t0 = time.perf_counter()
    if isinstance(engine, HTTPReceiver):
        with engine.paused(pause_mode):
            push_weights(
                items, engine, weight_version=version, bucket_bytes=bucket_bytes, verify=verify
            )
        return time.perf_counter() - t0
    engine.pause_generation(pause_mode)
    try:
        engine.update_weights_from_tensor(items, weight_version=version)
    finally:
        engine.continue_generation()
    pause_s = time.perf_counter() - t0
    if verify:
        want = {n: tensor_digest(t) for n, t in items}
        got = engine.weights_checksum(list(want))
        bad = [n for n in want if got.get(n) != want[n]]
        if bad:
            raise WeightMismatchError(bad, len(want))
    return pause_s


class SourceEndpoint:
    """One trainer rank's side: sends its shards for each update (rank 0 also drives it).

    Args:
        store: the Store the sink listens on.
        rank: this trainer rank (``0..sources-1``).
        setup: the ``setup_message`` string (identical on every rank; rank 0 writes it).
        host: the address this rank listens on.
        prefix: the key prefix.
        alive: rank 0 checks it while waiting for the sink's answer (e.g. the agent process
            still runs).
        api_key: proven on every connection to the sink; Store values are signed.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        setup: str,
        *,
        host: str = "127.0.0.1",
        prefix: str = "miles-p2p",
        alive: Callable[[], bool] | None = None,
        api_key: str | None = None,
    ) -> None:
        store = _signed(store, api_key)
        parsed = json.loads(setup)
        self.store, self.rank, self.prefix, self.alive = store, rank, prefix, alive
        self.verify = bool(parsed["verify"])
        src, dst = _layouts(parsed)
        self.plan = plan_transfer(src, dst)
        if rank == 0:
            store.set(f"{prefix}/setup", setup)
        self.transport = _transport(parsed["transport"], store, rank, host, prefix, api_key)
        self.sender = ShardSender(
            self.plan, rank, self.transport, bucket_bytes=int(parsed["bucket_bytes"])
        )
        self.n = 0
        self.sent_bytes = 0  # this rank's bytes in the last update (plan bytes, no padding)

    def send(self, shards: Mapping[str, torch.Tensor], weight_version: str) -> SinkReport | None:
        """Send this rank's shards (cast to the engine's dtype) as the next update.

        Returns:
            On rank 0 the sink's report, after the engine swapped the weights in; else None.

        Raises:
            RuntimeError: (rank 0) the engine side failed; its error is in the message.
        """
        self.n += 1
        if self.rank == 0:
            msg = json.dumps({"weight_version": weight_version})
            self.store.set(f"{self.prefix}/update/{self.n}", msg)
        if self.verify:
            digests = piece_digests(self.plan.src.rank(self.rank), shards)
            self.store.set(f"{self.prefix}/digests/{self.n}/{self.rank}", json.dumps(digests))
        self.sent_bytes = self.sender.send(shards).bytes
        if self.rank != 0:
            return None
        rep = SinkReport(
            **json.loads(_wait(self.store, f"{self.prefix}/done/{self.n}", self.alive))
        )
        if not rep.ok:
            raise RuntimeError(f"the engine side of the P2P update failed: {rep.error}")
        return rep

    def stop(self) -> None:
        """(rank 0) Tell the sink to stop serving."""
        if self.rank == 0:
            self.store.set(f"{self.prefix}/update/{self.n + 1}", json.dumps({"stop": True}))

    def close(self) -> None:
        self.transport.close()


def run_agent(
    engine_url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    prefix: str = "miles-p2p",
    parent_pid: int | None = None,
    out: Any = None,
    api_key: str | None = None,
    insecure_no_auth: bool = False,
) -> None:
    """The ``miles-transfer p2p-agent`` process: host the Store, receive, swap into the server.

    Prints ``p2p-agent ready at HOST:PORT`` (the address trainers connect to), then serves
    updates until the trainer stops it (or ``parent_pid`` exits). ``api_key`` is sent to the
    engine, demanded from the trainer ranks on every connection and signs the Store's values.

    Raises:
        ValueError: a non-loopback ``host`` without ``api_key`` or ``insecure_no_auth``.
    """
    check_bind(host, api_key, insecure_no_auth=insecure_no_auth, what="the p2p-agent")
    out = out or sys.stdout
    engine = HTTPReceiver(engine_url, api_key=api_key)
    rendezvous = torch.distributed.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    store = _signed(rendezvous, api_key)

    def alive() -> bool:
        return parent_pid is None or _pid_alive(parent_pid)

    print(f"p2p-agent ready at {host}:{rendezvous.port}", file=out, flush=True)
    setup = json.loads(_wait(store, f"{prefix}/setup", alive))
    sink = EngineSink(engine, store, setup, host=host, prefix=prefix, api_key=api_key)
    try:
        sink.serve(alive)
    finally:
        sink.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
