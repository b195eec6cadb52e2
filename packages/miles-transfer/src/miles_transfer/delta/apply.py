"""Apply a disk delta in place, all or nothing, and verify one without applying it.

``apply_delta(target, delta)`` first materializes the whole result into a hidden staging
directory inside ``target`` (same filesystem) and checks every checksum; only then does it swap
files: the old files move into a hidden backup directory, the new ones move into place, and a
journal records the swap while it happens. Any error before or during the swap leaves the
target exactly as it was, byte for byte (the swap is rolled back). If the process dies during
the swap itself, the next ``apply_delta`` (or ``recover_target``) on that directory sees the
journal and rolls the swap back first; ``verify_delta`` refuses such a directory.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from miles_transfer.delta.codec import checksum
from miles_transfer.delta.encode import Progress, _fsync_dir
from miles_transfer.delta.format import CheckpointIndex, dtype_name, load_manifest
from miles_transfer.delta.materialize import MaterializeReport, materialize_checkpoint

__all__ = ["VerifyReport", "apply_delta", "recover_target", "verify_delta"]

STAGING = ".miles-delta-staging"
BACKUP = ".miles-delta-backup"
JOURNAL = ".miles-delta-journal.json"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What ``verify_delta`` found.

    Attributes:
        state: ``"applicable"`` (the target is the delta's base: applying it gives the result,
            every checksum checked) or ``"applied"`` (the target already is the result).
        version: the result's version label from the manifest.
        message: one human-readable line.
    """

    state: Literal["applicable", "applied"]
    version: str | None
    message: str


def _checkpoint_files(target: Path) -> list[str]:
    return sorted(p.name for p in target.iterdir() if p.is_file() and not p.name.startswith("."))


def recover_target(target: str | Path) -> bool:
    """Roll back a swap that a dead process left half done; drop leftovers. True if it did.

    Safe to call on any directory: it only acts on the hidden journal, backup and staging
    entries that ``apply_delta`` creates.
    """
    target = Path(target)
    journal = target / JOURNAL
    acted = False
    if journal.is_file():
        plan = json.loads(journal.read_text())
        old, new = set(plan["old"]), set(plan["new"])
        backup = target / BACKUP
        for name in new:
            p = target / name
            if p.exists() and ((backup / name).exists() or name not in old):
                p.unlink()  # a new file already swapped in
        if backup.is_dir():
            for p in backup.iterdir():
                os.replace(p, target / p.name)
        _fsync_dir(target)
        journal.unlink()
        acted = True
    for leftover in (target / BACKUP, target / STAGING):
        if leftover.exists():
            shutil.rmtree(leftover)
            acted = True
    for p in target.glob(f".{STAGING}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    return acted


def _write_journal(target: Path, old: list[str], new: list[str]) -> None:
    tmp = target / (JOURNAL + ".tmp")
    with tmp.open("w") as f:
        json.dump({"old": old, "new": new}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target / JOURNAL)
    _fsync_dir(target)


def _swap(target: Path, staging: Path, removed: set[str]) -> None:
    """Replace the checkpoint's files by the staged ones. Files of ``target`` that the delta
    does not know (neither in the result, nor removed by it, nor ``*.safetensors``) stay."""
    new = _checkpoint_files(staging)
    old = [
        n
        for n in _checkpoint_files(target)
        if n in new or n in removed or n.endswith(".safetensors")
    ]
    backup = target / BACKUP
    backup.mkdir()
    _write_journal(target, old, new)
    moved: list[str] = []
    installed: list[str] = []
    try:
        for name in old:
            os.replace(target / name, backup / name)
            moved.append(name)
        for name in new:
            os.replace(staging / name, target / name)
            installed.append(name)
        _fsync_dir(target)
    except BaseException:
        for name in installed:
            os.replace(target / name, staging / name)
        for name in moved:
            os.replace(backup / name, target / name)
        _fsync_dir(target)
        (target / JOURNAL).unlink()
        raise
    (target / JOURNAL).unlink()  # the commit point
    _fsync_dir(target)


def apply_delta(
    target: str | Path, delta: str | Path, *, progress: Progress | None = None
) -> MaterializeReport:
    """Apply a delta to an HF safetensors directory in place, atomically.

    The result is fully written and checked (every tensor's xxh3-128) before any file of
    ``target`` changes; on any error ``target`` is left exactly as it was. Files the delta does
    not know (not part of the checkpoint it was made from, and not ``*.safetensors``) are left
    in place. An ``overwrite``
    delta may be applied again (idempotent); an ``xor`` delta is refused unless ``target`` is
    exactly its base.

    Args:
        target: the checkpoint directory to update.
        delta: a directory written by ``encode_delta``.
        progress: called as ``progress("apply", bytes_done, bytes_total)``.

    Raises:
        DeltaBaseError: ``target`` is not the delta's base (or, for xor, already the result);
            a ``ValueError``.
        ValueError: a corrupted, truncated or malformed delta, or a bad directory.
    """
    target = Path(target)
    if not target.is_dir():
        raise ValueError(f"{target}: not a directory")
    recover_target(target)
    staging = target / STAGING
    try:
        with CheckpointIndex(target) as idx:
            report, _ = materialize_checkpoint(idx, delta, staging, progress=progress)
        m, _ = load_manifest(delta)
        _swap(target, staging, set(m["removed_files"]))
    finally:
        if not (target / JOURNAL).exists():  # else a failed rollback: recover_target needs them
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(target / BACKUP, ignore_errors=True)
    return MaterializeReport(
        path=target,
        version=report.version,
        tensors=report.tensors,
        changed=report.changed,
        bytes=report.bytes,
        seconds=report.seconds,
    )


def _holds_result(idx: CheckpointIndex, delta: Path) -> bool:
    m, _ = load_manifest(delta)
    tensors = m["tensors"]
    if set(idx.tensors) != set(tensors):
        return False
    for name, t in tensors.items():
        e = idx.tensors[name]
        if dtype_name(e.dtype) != t["dtype"] or list(e.shape) != t["shape"]:
            return False
        if checksum(idx.read(name)) != t["checksum"]:
            return False
    return True


def verify_delta(
    target: str | Path, delta: str | Path, *, progress: Progress | None = None
) -> VerifyReport:
    """Check, without writing anything, that ``delta`` applies to ``target`` (or already did).

    Every payload frame is read, checked and decoded, and every result tensor's checksum is
    compared, exactly as ``apply_delta`` would.

    Raises:
        DeltaBaseError: ``target`` is neither the delta's base nor its result.
        ValueError: a corrupted, truncated or malformed delta, or a bad directory.
    """
    target = Path(target)
    if (target / JOURNAL).exists():
        raise ValueError(
            f"{target}: an interrupted apply left {JOURNAL}; run apply again (it rolls the "
            f"interrupted swap back first) or miles_transfer.delta.recover_target"
        )
    m, _ = load_manifest(delta)
    version = m["result"].get("version")
    with CheckpointIndex(target) as idx:
        if _holds_result(idx, Path(delta)):
            again = "idempotent" if m["encoding"] == "overwrite" else "an xor delta is refused"
            return VerifyReport(
                "applied",
                version,
                f"{target} already holds the delta's result ({len(m['tensors'])} tensors, "
                f"checksums equal); applying again: {again}",
            )
        report, _ = materialize_checkpoint(idx, delta, None, progress=progress)
    return VerifyReport(
        "applicable",
        version,
        f"{m['encoding']} delta applies to {target}: {len(report.changed)} of {report.tensors} "
        f"tensors change, every result checksum verified",
    )
