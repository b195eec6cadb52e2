"""Engine-side apply of a disk delta: everything is materialized first, generation pauses only
for the swap, and the pause is measured.

Three paths, by kind of engine:

- ``update_engine_from_delta(engine, base_dir, delta_dir)``: an engine that takes tensors
  (the embedded miles-rollout ``Engine``, a ``ModuleReceiver``, or an ``HTTPReceiver`` on the
  same host). The changed tensors are decoded and checked in memory, then
  ``pause_generation -> update_weights_from_tensor(changed) -> continue_generation``.
- ``update_engine_via_disk(engine, base_dir, delta_dir, out_dir)``: an engine that reloads
  from disk (SGLang's ``/update_weights_from_disk`` through ``HTTPReceiver``, or the embedded
  ``Engine``). The new full checkpoint directory is written on the engine host, then
  ``pause_generation -> update_weights_from_disk(out_dir) -> continue_generation``.

- ``EngineFollower(engine, publish_root).update()``: an in-process engine following a
  ``DeltaPublisher`` root with no local checkpoint copy at all: the served weights stay in memory
  as the base, every delta since the served version is decoded against it before the pause, and
  only the changed tensors are swapped.

If the engine refuses the update it keeps serving its old weights and version (both engines
update all or nothing), and generation is continued either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_transfer.delta.format import MANIFEST, PAYLOAD, CheckpointIndex, MemoryCheckpoint
from miles_transfer.delta.materialize import materialize_checkpoint
from miles_transfer.delta.publish import read_latest, version_dir_name, version_kind
from miles_transfer.protocols import DiskReloadEngine, PausableEngine

__all__ = [
    "DiskReloadEngine",
    "EngineFollower",
    "EngineUpdateReport",
    "PausableEngine",
    "update_engine_from_delta",
    "update_engine_via_disk",
]


@dataclass(frozen=True, slots=True)
class EngineUpdateReport:
    """Timings of one engine update from a delta.

    Attributes:
        weight_version: the version the engine serves afterwards.
        changed_tensors: tensors the delta changed.
        changed_bytes: bytes of those tensors (as stored in the checkpoint).
        materialize_seconds: decoding and checking, before the pause (generation went on).
        pause_seconds: from ``pause_generation`` to the end of ``continue_generation``.
        path: the checkpoint directory the engine reloaded from (disk path only).
        read_bytes: bytes read from the publish root (``EngineFollower``: the deltas, or the
            full snapshot's tensors; 0 where not measured).
        steps: how the engine got there (``EngineFollower``: ``["full 0", "delta 1"]``).
    """

    weight_version: str | None
    changed_tensors: int
    changed_bytes: int
    materialize_seconds: float
    pause_seconds: float
    path: Path | None = None
    read_bytes: int = 0
    steps: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"weight_version {self.weight_version}: {self.changed_tensors} tensors "
            f"({self.changed_bytes / 1e6:.1f} MB) materialized in "
            f"{self.materialize_seconds:.3f}s, generation paused {self.pause_seconds:.3f}s"
        )


def _paused(engine: Any, mode: str, swap: Any) -> float:
    t0 = time.perf_counter()
    engine.pause_generation(mode)
    try:
        swap()
    finally:
        engine.continue_generation()
    return time.perf_counter() - t0


def update_engine_from_delta(
    engine: PausableEngine,
    base_dir: str | Path,
    delta_dir: str | Path,
    *,
    weight_version: str | None = None,
    pause_mode: str = "in_place",
) -> EngineUpdateReport:
    """Apply a delta to an engine that holds ``base_dir``'s weights, pausing only for the swap.

    Args:
        engine: the miles-rollout ``Engine``, an ``HTTPReceiver`` (same host) or any
            ``PausableEngine``.
        base_dir: the checkpoint the engine serves now (the delta's base), on this host.
        delta_dir: the delta directory.
        weight_version: the version to serve afterwards (default: the delta's result version).
        pause_mode: SGLang's pause mode: ``"in_place"`` (keep the batch and its KV cache),
            ``"retract"`` or ``"abort"``.

    Raises:
        DeltaBaseError: ``base_dir`` is not the delta's base.
        ValueError: a corrupted delta, or the engine refused the update (it keeps serving
            the old weights).
    """
    t0 = time.perf_counter()
    with CheckpointIndex(base_dir) as base:
        report, changed = materialize_checkpoint(base, delta_dir, None, keep_tensors=True)
    version = weight_version if weight_version is not None else report.version
    items: list[tuple[str, torch.Tensor]] = list(changed.items())
    materialize_s = time.perf_counter() - t0

    def swap() -> None:
        if items:
            engine.update_weights_from_tensor(items, weight_version=version)

    pause_s = _paused(engine, pause_mode, swap)
    return EngineUpdateReport(
        weight_version=version,
        changed_tensors=len(items),
        changed_bytes=sum(t.numel() * t.element_size() for _, t in items),
        materialize_seconds=materialize_s,
        pause_seconds=pause_s,
    )


def update_engine_via_disk(
    engine: DiskReloadEngine,
    base_dir: str | Path,
    delta_dir: str | Path,
    out_dir: str | Path,
    *,
    weight_version: str | None = None,
    pause_mode: str = "in_place",
) -> EngineUpdateReport:
    """Materialize the new checkpoint on the engine host, then one ``update_weights_from_disk``.

    Args:
        engine: an ``HTTPReceiver`` for an SGLang(-compatible) server on this host, the
            miles-rollout ``Engine``, or any ``DiskReloadEngine``.
        base_dir: the checkpoint directory the engine serves now (only read).
        delta_dir: the delta directory.
        out_dir: the new checkpoint directory to write (must not exist, or be empty); the
            engine is pointed at it. Keep ``base_dir`` until the update succeeded.
        weight_version: the version to serve afterwards (default: the delta's result version).
        pause_mode: SGLang's pause mode.

    Raises:
        DeltaBaseError: ``base_dir`` is not the delta's base (nothing written, engine untouched).
        ValueError: a corrupted delta.
        ReceiverError: the engine refused the reload (it keeps serving the old weights).
    """
    t0 = time.perf_counter()
    with CheckpointIndex(base_dir) as base:
        report, _ = materialize_checkpoint(base, delta_dir, out_dir)
    version = weight_version if weight_version is not None else report.version
    materialize_s = time.perf_counter() - t0
    path = str(Path(out_dir).resolve())
    pause_s = _paused(
        engine, pause_mode, lambda: engine.update_weights_from_disk(path, weight_version=version)
    )
    with CheckpointIndex(out_dir) as out:
        changed_bytes = sum(out.tensors[n].nbytes for n in report.changed)
    return EngineUpdateReport(
        weight_version=version,
        changed_tensors=len(report.changed),
        changed_bytes=changed_bytes,
        materialize_seconds=materialize_s,
        pause_seconds=pause_s,
        path=Path(out_dir),
    )


class EngineFollower:
    """Keep an in-process engine on the newest version of a ``DeltaPublisher`` root.

    The weights the engine serves are kept as one CPU copy in rollout precision, the base each
    next delta is decoded against, so nothing is written to disk on the engine's side. Each
    :meth:`update` decodes every delta since the served version (checksums verified) while the
    engine keeps generating, then swaps only the changed tensors with one
    ``update_weights_from_tensor`` between ``pause_generation`` and ``continue_generation``. A
    fresh follower loads the newest full snapshot at or before the target first.

    Args:
        engine: the miles-rollout ``Engine``, a ``ModuleReceiver``-like object or any
            ``PausableEngine``.
        publish_root: the publisher's directory (same filesystem).
        pause_mode: SGLang's pause mode for the swap (``"in_place"`` keeps the batch).
    """

    def __init__(
        self, engine: PausableEngine, publish_root: str | Path, *, pause_mode: str = "in_place"
    ) -> None:
        self.engine = engine
        self.root = Path(publish_root)
        self.pause_mode = pause_mode
        self.version: int | None = None
        self._base: dict[str, torch.Tensor] = {}
        # config.json, tokenizer files: deltas check them against their base (they do not
        # change during a run; a delta that changes one is checked, then it is kept as it was).
        self._other: dict[str, bytes] = {}

    def served(self) -> dict[str, torch.Tensor]:
        """The weights the engine serves now (rollout precision, by HF name; do not modify)."""
        return dict(self._base)

    def update(self, version: int | None = None) -> EngineUpdateReport:
        """Bring the engine to ``version`` (default: the publisher's ``LATEST``).

        Raises:
            ValueError: nothing published, a missing version, or a corrupted delta (the engine
                keeps serving its weights and version).
            DeltaBaseError: the served base does not match the delta's.
        """
        t0 = time.perf_counter()
        target = read_latest(self.root) if version is None else version
        if target is None:
            raise ValueError(f"{self.root}: nothing published yet (no LATEST)")
        have = self.version
        if have is not None and target < have:
            raise ValueError(f"the engine serves version {have}, newer than {target}")
        base, other = dict(self._base), dict(self._other)
        steps: list[str] = []
        changed: set[str] = set()
        read_bytes = 0
        start = have
        if start is None:
            fulls = [v for v in range(target, -1, -1) if _is_full(self.root, v)]
            if not fulls:
                raise ValueError(f"{self.root}: no full snapshot at or before version {target}")
            start = fulls[0]
            with CheckpointIndex(self.root / version_dir_name(start)) as snap:
                for name in snap.tensors:
                    base[name] = snap.read(name)
                other = {n: snap.read_other(n) for n in snap.other_files}
                read_bytes += sum(e.nbytes for e in snap.tensors.values())
            changed.update(base)
            steps.append(f"full {start}")
        for v in range(start + 1, target + 1):
            d = self.root / version_dir_name(v)
            delta = d / "delta" if version_kind(self.root, v) == "full" else d
            read_bytes += (delta / MANIFEST).stat().st_size + (delta / PAYLOAD).stat().st_size
            _, new = materialize_checkpoint(
                MemoryCheckpoint(list(base.items()), other), delta, None, keep_tensors=True
            )
            base.update(new)
            changed.update(new)
            steps.append(f"delta {v}")
        items = [(n, base[n]) for n in base if n in changed]
        materialize_s = time.perf_counter() - t0

        def swap() -> None:
            if items:
                self.engine.update_weights_from_tensor(items, weight_version=str(target))

        pause_s = _paused(self.engine, self.pause_mode, swap)
        self._base, self._other, self.version = base, other, target
        return EngineUpdateReport(
            weight_version=str(target),
            changed_tensors=len(items),
            changed_bytes=sum(t.numel() * t.element_size() for _, t in items),
            materialize_seconds=materialize_s,
            pause_seconds=pause_s,
            read_bytes=read_bytes,
            steps=tuple(steps),
        )


def _is_full(root: Path, v: int) -> bool:
    try:
        return version_kind(root, v) == "full"
    except ValueError:
        return False
