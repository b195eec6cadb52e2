"""Engine-side apply of a disk delta: everything is materialized first, generation pauses only
for the swap, and the pause is measured.

Two paths, one per kind of engine:

- ``update_engine_from_delta(engine, base_dir, delta_dir)``: an engine that takes tensors
  (the embedded miles-rollout ``Engine``, a ``ModuleReceiver``, or an ``HTTPReceiver`` on the
  same host). The changed tensors are decoded and checked in memory, then
  ``pause_generation -> update_weights_from_tensor(changed) -> continue_generation``.
- ``update_engine_via_disk(engine, base_dir, delta_dir, out_dir)``: an engine that reloads
  from disk (SGLang's ``/update_weights_from_disk`` through ``HTTPReceiver``, or the embedded
  ``Engine``). The new full checkpoint directory is written on the engine host, then
  ``pause_generation -> update_weights_from_disk(out_dir) -> continue_generation``.

If the engine refuses the update it keeps serving its old weights and version (both engines
update all or nothing), and generation is continued either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_transfer.delta.format import CheckpointIndex
from miles_transfer.delta.materialize import materialize_checkpoint
from miles_transfer.protocols import DiskReloadEngine, PausableEngine

__all__ = [
    "DiskReloadEngine",
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
    """

    weight_version: str | None
    changed_tensors: int
    changed_bytes: int
    materialize_seconds: float
    pause_seconds: float
    path: Path | None = None

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
