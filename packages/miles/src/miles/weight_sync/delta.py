"""``transfer.method: delta``: publish disk deltas that the engines pull and apply.

After each step every rank takes part in the gather of the full weights (FSDP2 all-gathers, or
the Megatron backend's ``named_hf_tensors``); rank 0 casts them to the engine's precision and
publishes version ``N`` as ``weight_v{N:06d}/`` under ``transfer.delta.dir`` (default
``weights/`` in the run directory): a full snapshot for the first version and every
``full_every`` versions, else only the elements whose bits changed (xor or overwrite, zstd).

The engine then pulls it, decoding before it pauses:

- the embedded engine follows the publish root in memory (``EngineFollower``): deltas are
  decoded against the weights it serves, then only the changed tensors are swapped between
  ``pause_generation`` and ``continue_generation``;
- a ``miles-rollout serve`` (or SGLang) process on the same filesystem: the version is
  materialized in ``transfer.delta.local_dir`` by a ``DeltaSubscriber`` (a few versions behind:
  the deltas in between, in one pass), then the engine reloads it with
  ``update_weights_from_disk`` (the engine stops only for its copy).

``sync`` returns (logged as ``update/*``): ``bytes`` (what the engine read from the publish
root: the delta files, or a full snapshot's tensors), ``full_bytes`` (the weights in rollout
precision, what a full update moves), ``delta_bytes`` (this version's delta files, compressed),
``raw_bytes`` (the changed values alone, uncompressed) and ``raw_sparse_bytes`` (plus an int32
position each), ``changed_fraction`` (changed elements / all), ``kind``, ``publish_s``,
``materialize_s`` (before the pause), ``pause_s`` (what the engine saw), ``verify_s`` and
``verified`` (the engine's per-tensor digests equal the published weights', bit for bit).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from miles.protocols import Trainer
from miles_transfer import WeightReceiver, tensor_digest
from miles_transfer.delta import DeltaPublisher, DeltaSubscriber, EngineFollower, read_latest
from miles_transfer.delta.format import MANIFEST, PAYLOAD
from miles_transfer.p2p import tied_names
from miles_transfer.push import HTTPReceiver, WeightMismatchError, iter_full_state

__all__ = ["DeltaSync", "hf_state"]

_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def hf_state(trainer: Trainer) -> tuple[Iterator[tuple[str, torch.Tensor]], set[str]]:
    """The trainer's full weights under HF names, and the tied names to leave out.

    A collective: every rank must drain the iterator. The Megatron backend gathers with
    ``named_hf_tensors`` (it yields each tied tensor once); other trainers expose a module
    (FSDP2 shards are gathered one tensor at a time), whose tied aliases (``lm_head.weight``
    of a tied embedding) would otherwise be published twice.
    """
    named = getattr(trainer, "named_hf_tensors", None)
    if callable(named):
        return iter(named()), set()
    model = getattr(trainer, "model", None)
    if model is None:
        raise TypeError(f"{type(trainer).__name__} has neither named_hf_tensors() nor .model")
    return iter_full_state(model), tied_names(model)


def _delta_files_bytes(path: Path) -> int:
    return (path / MANIFEST).stat().st_size + (path / PAYLOAD).stat().st_size


class DeltaSync:
    """Publish each step as a disk delta and bring the engine to it (see the module docstring).

    Args:
        receiver: rank 0's engine: the embedded ``Engine`` (followed in memory) or an
            ``HTTPReceiver`` of a server on this filesystem; ``None`` on other ranks.
        root: the publish directory (created on the first sync).
        model_path: the initial checkpoint; its non-weight files (``config.json``, tokenizer)
            travel with every full snapshot, so each version is a loadable HF directory.
        local_dir: where an HTTP engine's versions are materialized (default ``root/engine``).
        encoding: ``"xor"`` or ``"overwrite"``.
        full_every: a full snapshot every this many versions.
        verify: compare the engine's digests with the published weights after each update.
        owns_root: ``root`` belongs to this run (``weights/`` in its directory): versions a
            resumed run finds there are cleared (a configured directory with versions is
            refused instead, by ``DeltaPublisher``).
    """

    def __init__(
        self,
        receiver: WeightReceiver | None,
        *,
        root: Path,
        model_path: str,
        local_dir: Path | None = None,
        encoding: str = "xor",
        full_every: int = 10,
        verify: bool = True,
        owns_root: bool = False,
    ) -> None:
        self.receiver = receiver
        self.owns_root = owns_root
        self.root = Path(root)
        self.model_path = model_path
        self.local_dir = Path(local_dir) if local_dir is not None else self.root / "engine"
        self.encoding = encoding
        self.full_every = full_every
        self.verify = verify
        self._publisher: DeltaPublisher | None = None
        self._follower: EngineFollower | None = None
        self._subscriber: DeltaSubscriber | None = None
        if receiver is not None and receiver.dtype not in _PRECISION:
            raise ValueError(
                f"transfer.method delta publishes fp32, bf16 or fp16 weights; the engine serves "
                f"{receiver.dtype}"
            )

    def _start(self) -> DeltaPublisher:
        assert self.receiver is not None
        if self.owns_root and read_latest(self.root) is not None:
            # A resumed run: its earlier versions describe weights no engine serves any more
            # (the engines restart from the checkpoint), so the chain starts afresh.
            for d in (self.root, self.local_dir):
                if d.is_dir():
                    for old in d.iterdir():
                        if old.name != "LATEST" and not old.name.lstrip(".").startswith("weight_v"):
                            continue
                        if old.is_dir():
                            shutil.rmtree(old)
                        else:
                            old.unlink()
        publisher = DeltaPublisher(
            self.root,
            encoding="xor" if self.encoding == "xor" else "overwrite",
            full_every=self.full_every,
            precision=_PRECISION[self.receiver.dtype],
            other_files=self.model_path,
        )
        if isinstance(self.receiver, HTTPReceiver):
            self._subscriber = DeltaSubscriber(self.root, self.local_dir)
        else:
            self._follower = EngineFollower(self.receiver, self.root)  # type: ignore[arg-type]
        return publisher

    def sync(self, trainer: Trainer, version: int) -> dict[str, Any]:
        """Publish ``version`` and update the engine (a collective on every rank)."""
        state, tied = hf_state(trainer)
        if self.receiver is None:
            for _ in state:  # take part in the gathers; rank 0 publishes
                pass
            return {}
        dtype = self.receiver.dtype
        t0 = time.perf_counter()
        items = [
            (n, t.to(dtype) if t.is_floating_point() else t) for n, t in state if n not in tied
        ]
        if self._publisher is None:
            self._publisher = self._start()
        pub = self._publisher.publish(items, version=version)
        publish_s = time.perf_counter() - t0

        if self._follower is not None:
            rep = self._follower.update(version)
            read_bytes, materialize_s, pause_s = (
                rep.read_bytes,
                rep.materialize_seconds,
                rep.pause_seconds,
            )
        else:
            assert self._subscriber is not None
            assert isinstance(self.receiver, HTTPReceiver)
            t1 = time.perf_counter()
            pulled = self._subscriber.pull(version)
            materialize_s = time.perf_counter() - t1
            read_bytes = self._pulled_bytes(pulled.steps)
            t1 = time.perf_counter()
            self.receiver.update_weights_from_disk(str(pulled.path), weight_version=str(version))
            pause_s = time.perf_counter() - t1

        verify_s, verified = 0.0, False
        if self.verify:
            t1 = time.perf_counter()
            want = {n: tensor_digest(t) for n, t in items}
            got = self.receiver.weights_checksum(list(want))
            bad = [n for n in want if got.get(n) != want[n]]
            if bad:
                raise WeightMismatchError(bad, len(want))
            verify_s, verified = time.perf_counter() - t1, True

        out: dict[str, Any] = {
            "weight_version": str(version),
            "method": "delta",
            "kind": pub.kind,
            "bytes": read_bytes,
            "full_bytes": pub.full_bytes,
            "publish_s": publish_s,
            "materialize_s": materialize_s,
            "pause_s": pause_s,
            "verify_s": verify_s,
            "verified": verified,
        }
        d = pub.delta
        if d is not None:
            itemsize = d.full_bytes / max(d.elements, 1)
            out |= {
                "delta_bytes": d.payload_bytes + d.manifest_bytes,
                "changed_fraction": d.changed_fraction,
                "changed_elements": d.changed_elements,
                "raw_bytes": int(d.changed_elements * itemsize),
                "raw_sparse_bytes": int(d.changed_elements * (itemsize + 4)),
            }
        return out

    def _pulled_bytes(self, steps: tuple[str, ...]) -> int:
        """Bytes a subscriber read from the publish root for ``steps`` (``"full N"``, ...)."""
        total = 0
        for step in steps:
            kind, v = step.split()
            d = self.root / f"weight_v{int(v):06d}"
            if kind == "full":
                total += sum(p.stat().st_size for p in d.glob("*.safetensors"))
            else:
                total += _delta_files_bytes(d / "delta" if (d / "delta").is_dir() else d)
        return total

    def close(self) -> None:
        """Nothing to release (files stay in the publish directory for inspection)."""
