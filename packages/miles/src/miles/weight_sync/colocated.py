"""``transfer.method: colocated``: every trainer rank on the engine's devices sends its own copy.

The layout slime and Miles use with SGLang on shared GPUs: engine TP rank ``i`` sits on trainer
rank ``i``'s GPU. After the gathers every trainer rank holds the full weights; trainer ranks
``0 .. tp_size-1`` each serialise their copy where it lies (CUDA IPC handles on GPU, a
shared-memory file on CPU), rank 0 gathers the payloads and posts them to the engine's
``/update_weights_from_tensor`` in one request (``miles_transfer.push.ColocatedReceiver``); TP
rank ``i`` opens payload ``i``. No bytes go over a socket. Trainer ranks beyond the engine's
``tp_size`` join the gathers only.

The engine is the embedded engine (a CPU engine in rank 0's process, reached over a loopback
server this sync starts with a key of its own) or ``rollout.engine_url`` on this host (SGLang on
the trainer's GPUs, or ``miles-rollout serve --allow-pickle-weights``). The payloads are
SGLang's torch pickles, so the recipe opts in (``transfer.colocated.allow_pickle_weights``) and
an engine that refuses them is an error before the first step.

``sync`` returns (``update/*``), on rank 0: ``bytes`` (what each sending rank shares with the
engine), ``buckets``, ``payloads`` (one per TP rank), ``send_s``, ``verify_s``, ``verified``
and ``engine_pause_s`` (time inside the engine's update calls: the pause generation saw).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from miles.protocols import Trainer
from miles.weight_sync.push import _Timed
from miles_rollout import Engine
from miles_transfer import SyncReport, WeightReceiver, push_module_weights, push_weights
from miles_transfer.push import ColocatedReceiver, HTTPReceiver, TorchDistGroup
from miles_transfer.push.colocated import PayloadGroup, SingleProcessGroup

__all__ = ["ColocatedSync"]

logger = logging.getLogger(__name__)

_PICKLED_FORMAT = "flattened_bucket"  # what ColocatedReceiver sends (SGLang's format)


class ColocatedSync:
    """Colocated updates from every trainer rank on the engine's devices (module docstring).

    Args:
        receiver: rank 0's engine: the embedded ``Engine``, or the ``HTTPReceiver`` of
            ``rollout.engine_url``; ``None`` on other ranks.
        engine_url: ``rollout.engine_url`` (``None``: the embedded engine).
        api_key: the engine's key (``rollout.api_key``); the embedded engine's server gets a
            fresh one of its own.
        bucket_bytes: bucket size.
        verify: compare the engine's digests with every sending rank's after each update.
        handle_version: see ``miles_transfer.push.serialize_cuda_ipc`` (GPU only).
        check_handles: check every CUDA payload with cuda-python before sending (GPU only).
    """

    def __init__(
        self,
        receiver: WeightReceiver | None,
        *,
        engine_url: str | None,
        api_key: str | None = None,
        bucket_bytes: int,
        verify: bool,
        handle_version: int | None = None,
        check_handles: bool = False,
    ) -> None:
        self.receiver = receiver
        self.engine_url = engine_url
        self.api_key = api_key
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.handle_version = handle_version
        self.check_handles = check_handles
        self.tp_size: int | None = None
        self._rx: _Timed | None = None  # this rank's ColocatedReceiver (timed), if it sends
        self._ctl: Any = None  # a gloo group over every rank: errors travel on it
        self._server: Any = None  # the embedded engine's loopback server (rank 0)
        self._embedded = False
        self._closed = False

    # ------------------------------------------------------------------ setup (first sync)

    def _engine_side(self) -> tuple[str, int, str | None, str]:
        """Rank 0: the engine's URL, TP size, the key to post with and its dtype (checked)."""
        assert self.receiver is not None
        dtype = str(self.receiver.dtype).removeprefix("torch.")
        if isinstance(self.receiver, Engine) and self.engine_url is None:
            self._embedded = True
            key = secrets.token_urlsafe(32)  # only this run's trainer may post pickles to it
            from miles_rollout.server import serve

            self._server = serve(self.receiver, api_key=key, allow_pickle_weights=True)
            return self._server.url, 1, key, dtype
        if not isinstance(self.receiver, HTTPReceiver) or self.engine_url is None:
            raise ValueError(
                "transfer.method colocated needs the embedded engine or one engine at "
                f"rollout.engine_url; got {type(self.receiver).__name__}"
            )
        url = self.engine_url
        host = urllib.parse.urlsplit(url).hostname or ""
        if not _on_this_host(host):
            raise ValueError(
                f"transfer.method colocated: rollout.engine_url={url} is not on this host; "
                "its payloads are CUDA IPC handles and shared-memory files, which only a process "
                "on the trainer's host (its GPUs) can open. Run the engine beside the trainer, "
                "or use transfer.method p2p (any host) or delta (a shared filesystem)"
            )
        info = _server_info(url, self.api_key, self.receiver.timeout)
        formats = info.get("weight_load_formats")
        if isinstance(formats, list) and _PICKLED_FORMAT not in formats:
            raise ValueError(
                f"the engine at {url} refuses pickled weight payloads (its weight_load_formats "
                f"are {formats}); transfer.method colocated sends SGLang's pickled "
                "update_weights_from_tensor payloads: restart it with `miles-rollout serve "
                "... --allow-pickle-weights`, or use transfer.method push"
            )
        return url, self.receiver.tp_size, self.api_key, dtype

    def _setup(self, rank: int, world: int) -> None:
        if world > 1:
            # Object collectives on the CPU whatever the trainer's backend (NCCL on GPU).
            self._ctl = dist.new_group(backend="gloo")
        side: tuple[str, int, str | None, str] | None = None
        error: str | None = None
        if rank == 0:
            try:
                side = self._engine_side()
                if side[1] > world:
                    raise ValueError(
                        f"the engine at {side[0]} has tp_size={side[1]} but the trainer has "
                        f"{world} rank(s): transfer.method colocated needs a trainer rank on "
                        f"each of the engine's GPUs (torchrun --nproc_per_node {side[1]}, "
                        "rank i on TP rank i's GPU)"
                    )
            except (ValueError, OSError) as e:
                error = str(e)
        # The URL and key go to the group's ranks only in memory (gloo), never to a log.
        side, error = self._bcast((side, error), world)
        if error is not None:
            self.close()
            raise ValueError(error)
        assert side is not None
        url, tp_size, key, dtype = side
        group: PayloadGroup | None = None
        if tp_size == 1:
            group = SingleProcessGroup() if rank == 0 else None
        else:
            sub = self._ctl
            if tp_size < world:  # every rank creates it, the first tp_size ranks use it
                sub = dist.new_group(list(range(tp_size)), backend="gloo")
            group = TorchDistGroup(sub) if rank < tp_size else None
        if rank == 0 and world > tp_size:
            logger.info(
                "colocated: trainer ranks %d..%d hold no engine TP rank; they join the gathers "
                "only",
                tp_size,
                world - 1,
            )
        failure: BaseException | None = None
        if group is not None:
            from miles.preflight import start_shm_manager_detached

            start_shm_manager_detached()  # CPU payloads: the manager must not hold our stderr
            try:
                rx = ColocatedReceiver(
                    url if group.rank == 0 else None,
                    dtype=dtype,
                    group=group,
                    handle_version=self.handle_version,
                    check_handles=self.check_handles,
                    api_key=key,
                )
                self._rx = _Timed(rx)
            except Exception as e:  # ValueError, ReceiverError, ImportError: every rank stops
                failure = e
        self._agree(failure, world)
        self.tp_size = tp_size

    def _bcast(self, obj: Any, world: int) -> Any:
        if world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctl)
        return box[0]

    def _agree(self, failure: BaseException | None, world: int) -> None:
        """Raise on every rank when any rank failed (none is left waiting in a collective)."""
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        errors: list[Any] = [mine]
        if world > 1:
            errors = [None] * world
            dist.all_gather_object(errors, mine, group=self._ctl)
        if failure is not None:
            raise failure
        for r, e in enumerate(errors):
            if e is not None:
                raise RuntimeError(f"transfer.method colocated failed on trainer rank {r}: {e}")

    # ------------------------------------------------------------------ per step

    def sync(self, trainer: Trainer, version: int) -> dict[str, Any]:
        """Send every sending rank's copy and (optionally) verify; a collective on every rank.

        Raises:
            ValueError: a bad setup (the engine, the URL, the ranks), on every rank.
            RuntimeError: a rank's update failed (the others name it).
        """
        rank, world = trainer.rank, trainer.world_size
        if self.tp_size is None:
            self._setup(rank, world)
        failure: BaseException | None = None
        report: SyncReport | None = None
        if self._rx is not None:
            self._rx.seconds = 0.0
        try:
            report = self._push(trainer, str(version))
        except Exception as e:
            failure = e
        self._agree(failure, world)
        if report is None or rank != 0:
            return {}
        assert self._rx is not None
        return {
            "weight_version": report.weight_version,
            "method": "colocated",
            "bytes": report.bytes,
            "buckets": report.buckets,
            "payloads": self.tp_size,
            "send_s": report.send_seconds,
            "verify_s": report.verify_seconds,
            "verified": report.verified,
            "engine_pause_s": self._rx.seconds,
        }

    def _push(self, trainer: Trainer, version: str) -> SyncReport | None:
        named = getattr(trainer, "named_hf_tensors", None)
        rx = self._checked_receiver()
        if not callable(named):
            model = getattr(trainer, "model", None)
            if model is None:
                raise TypeError(f"{type(trainer).__name__} has no .model to push weights from")
            return push_module_weights(
                model, rx, weight_version=version, bucket_bytes=self.bucket_bytes,
                verify=self.verify,
            )  # fmt: skip
        stream: Iterator[tuple[str, torch.Tensor]] = named()
        try:
            if rx is None:
                return None
            return push_weights(
                stream, rx, weight_version=version, bucket_bytes=self.bucket_bytes,
                verify=self.verify,
            )  # fmt: skip
        finally:
            for _ in stream:  # the stream's gathers are collectives: every rank drains it
                pass

    def _checked_receiver(self) -> WeightReceiver | None:
        if self._rx is None or not self._embedded:
            return self._rx
        return _CPUOnly(self._rx)

    def close(self) -> None:
        """Stop the embedded engine's loopback server (idempotent; the engine keeps running)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()


class _CPUOnly:
    """The embedded engine computes on the CPU in rank 0's process: CUDA IPC cannot reach it."""

    def __init__(self, inner: _Timed) -> None:
        self.inner = inner
        self.dtype = inner.dtype

    def update_weights_from_tensor(self, named_tensors: Any, **kwargs: Any) -> None:
        items = list(named_tensors)
        if any(t.is_cuda for _, t in items):
            raise ValueError(
                "transfer.method colocated with the embedded engine sends CPU shared memory, "
                "but the trainer's weights are on a GPU: colocate with an SGLang engine on the "
                "trainer's GPUs (rollout.engine_url), or use transfer.method push"
            )
        self.inner.update_weights_from_tensor(items, **kwargs)

    def weights_checksum(self, names: Any = None) -> dict[str, str]:
        return self.inner.weights_checksum(names)


def _on_this_host(host: str) -> bool:
    """Whether ``host`` names an address of this machine (binding to it succeeds)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, kind, _, _, addr in infos:
        try:
            with socket.socket(family, kind) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def _server_info(url: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/get_server_info")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            info = json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"transfer.method colocated: GET {url}/get_server_info failed: {e}") from e
    return info if isinstance(info, dict) else {}
