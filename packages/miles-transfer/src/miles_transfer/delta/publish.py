"""Versioned publishing of disk deltas (trainer side) and pulling them (engine host side).

Layout under the publish root (shared storage, or copied to engine hosts by any means)::

    root/
      LATEST                      "12" (written last, atomically)
      weight_v000010/             full snapshot: an HF checkpoint (model.safetensors, config...)
        model.safetensors ...
        delta/                    the delta from version 9 (so version-9 holders stay cheap)
        version.json              {"version": 10, "kind": "full", "base": 9}
      weight_v000011/             delta.json + delta.bin against version 10
        version.json              {"version": 11, "kind": "delta", "base": 10}

A full snapshot every ``full_every`` versions bounds the chain: a host that starts fresh (or
falls further behind than its ``max_chain``) copies the latest snapshot and applies at most
``full_every - 1`` deltas after it; a host that is only a few versions behind applies the
deltas in between (each a few percent of a full copy). Each version directory appears
atomically (written under a hidden name, then renamed), and ``LATEST`` moves only after it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_transfer.delta.chain import materialize_chain
from miles_transfer.delta.codec import ENCODINGS, Encoding
from miles_transfer.delta.encode import (
    DEFAULT_CHUNK_ELEMS,
    DeltaReport,
    _fsync_dir,
    encode_checkpoints,
)
from miles_transfer.delta.format import CheckpointIndex, MemoryCheckpoint

__all__ = [
    "DeltaPublisher",
    "DeltaSubscriber",
    "PublishReport",
    "PullReport",
    "read_latest",
    "version_dir_name",
    "version_kind",
]

_VERSION_RE = re.compile(r"^weight_v(\d{6,})$")
_FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Quantized rollout precisions: miles-quant's checkpoint export (engine layouts), imported lazily.
QUANT_PRECISIONS = ("fp8_block128", "mxfp4", "nvfp4", "int4_g32", "int4_g128")


def _quantized(snap: MemoryCheckpoint, fmt: str) -> MemoryCheckpoint:
    """The bf16 snapshot exported to a quantized engine layout by miles-quant."""
    try:
        # Optional, user-installed: not a dependency of this package (Pants: no inferred dep).
        from miles_quant.checkpoint import export_checkpoint  # pants: no-infer-dep
    except ImportError as e:
        raise ImportError(
            f"precision={fmt!r} quantizes through miles-quant ({e}); install it with: "
            f"pip install 'miles-quant[checkpoint]'"
        ) from e
    if "config.json" not in snap.other_files:
        raise ValueError(
            f"precision={fmt!r} needs the model's config.json in other_files (miles-quant "
            f"reads it and records the quantization there)"
        )
    with tempfile.TemporaryDirectory(prefix="miles-delta-quant-") as tmp:
        src, dst = Path(tmp) / "bf16", Path(tmp) / fmt
        src.mkdir()
        snap.write(src)
        export_checkpoint(src, dst, fmt)
        with CheckpointIndex(dst) as q:
            items = [(n, q.read(n)) for es in q.files.values() for n in (e.name for e in es)]
            other = {n: q.read_other(n) for n in q.other_files}
    return MemoryCheckpoint(items, other)


def version_dir_name(version: int) -> str:
    """``weight_v{version:06d}``."""
    return f"weight_v{version:06d}"


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(root: str | Path) -> int | None:
    """The version ``LATEST`` names under a publish root (``None`` before the first publish)."""
    root = Path(root)
    p = root / "LATEST"
    if not p.is_file():
        return None
    text = p.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{p}: holds {text!r}, not a version number")
    return int(text)


def version_kind(root: str | Path, version: int) -> str:
    """``"full"`` or ``"delta"``: what the publisher wrote for ``version``.

    Raises:
        ValueError: the version was never (fully) published.
    """
    meta = Path(root) / version_dir_name(version) / "version.json"
    if not meta.is_file():
        raise ValueError(f"{meta} is missing: version {version} was never (fully) published")
    return str(json.loads(meta.read_text())["kind"])


@dataclass(frozen=True, slots=True)
class PublishReport:
    """One published version.

    Attributes:
        version: the version number.
        path: its directory.
        kind: ``"full"`` (snapshot, plus the delta from the previous version if any) or
            ``"delta"``.
        delta: the delta's report (``None`` for the very first version).
        full_bytes: bytes of the tensors in rollout precision.
        seconds: wall time of ``publish``.
    """

    version: int
    path: Path
    kind: str
    delta: DeltaReport | None
    full_bytes: int
    seconds: float


class DeltaPublisher:
    """Publish successive policy weights as ``weight_v{N:06d}/`` directories.

    Keeps the last published weights (in rollout precision) as a CPU snapshot and diffs each
    new version against it.

    Args:
        root: the publish directory (created if missing).
        encoding: ``"xor"`` (smallest) or ``"overwrite"`` (idempotent).
        full_every: a full snapshot every this many versions (version % full_every == 0).
        precision: the rollout precision the engines load. ``"bf16"``, ``"fp16"``, ``"fp32"``:
            floating tensors are cast. ``"fp8_block128"``, ``"mxfp4"``, ``"nvfp4"``,
            ``"int4_g32"``, ``"int4_g128"``: cast to bf16, then exported to that engine layout
            by miles-quant (``pip install 'miles-quant[checkpoint]'``; needs ``config.json``
            in ``other_files``; goes through a temporary directory). ``None``: tensors as
            given.
        other_files: files that travel with every full snapshot and delta (``config.json``,
            tokenizer files): ``{name: bytes}``, or a directory whose top-level
            non-safetensors files are taken.
        chunk_elems: see ``encode_delta``.

    Raises:
        ValueError: a bad argument, or ``root`` already holds versions (pass ``resume``
            by starting a new root; the snapshot is not on disk in a diffable form).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        encoding: Encoding = "xor",
        full_every: int = 10,
        precision: str | None = "bf16",
        other_files: dict[str, bytes] | str | Path | None = None,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        if precision is not None and precision not in (*_FLOAT_DTYPES, *QUANT_PRECISIONS):
            raise ValueError(
                f"precision must be one of {[*_FLOAT_DTYPES, *QUANT_PRECISIONS]} or None "
                f"(tensors as given), got {precision!r}"
            )
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if read_latest(self.root) is not None:
            raise ValueError(
                f"{self.root} already holds published versions; publish into a new directory "
                f"(a publisher diffs against its in-memory snapshot, which a restart loses)"
            )
        self.encoding: Encoding = encoding
        self.full_every = full_every
        self.precision = precision
        self.chunk_elems = chunk_elems
        if isinstance(other_files, (str, Path)):
            src = Path(other_files)
            self.other_files = {
                p.name: p.read_bytes()
                for p in sorted(src.iterdir())
                if p.is_file() and p.suffix != ".safetensors" and not p.name.startswith(".")
            }
        else:
            self.other_files = dict(other_files or {})
        self._snapshot: MemoryCheckpoint | None = None
        self.version: int | None = None

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> MemoryCheckpoint:
        quant = self.precision in QUANT_PRECISIONS
        dtype = (
            None if self.precision is None else _FLOAT_DTYPES.get(self.precision, torch.bfloat16)
        )
        items = []
        for name, t in named_tensors:
            src = t.detach()
            cast = dtype if dtype is not None and src.is_floating_point() else src.dtype
            out = src.to("cpu", dtype=cast).contiguous()
            if out.data_ptr() == src.data_ptr():
                out = out.clone()  # own memory: the caller's tensors change after publish
            items.append((name, out))
        snap = MemoryCheckpoint(items, self.other_files)
        return _quantized(snap, str(self.precision)) if quant else snap

    def publish(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None
    ) -> PublishReport:
        """Publish the given weights (HF names) as the next version.

        Args:
            named_tensors: e.g. ``miles_transfer.push.iter_full_state(model)`` or
                ``model.state_dict().items()``.
            version: the version number (default: previous + 1, starting at 0); must grow.

        Returns:
            What was written and how big the delta was.
        """
        t0 = time.perf_counter()
        v = (0 if self.version is None else self.version + 1) if version is None else version
        if self.version is not None and v <= self.version:
            raise ValueError(f"version {v} must be greater than the last one ({self.version})")
        snap = self._prepare(named_tensors)
        final = self.root / version_dir_name(v)
        staging = self.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        full = self._snapshot is None or v % self.full_every == 0
        delta: DeltaReport | None = None
        try:
            if self._snapshot is not None:
                delta = encode_checkpoints(
                    self._snapshot,
                    snap,
                    staging / "delta" if full else staging,
                    encoding=self.encoding,
                    chunk_elems=self.chunk_elems,
                    base_version=str(self.version),
                    version=str(v),
                )
            if full:
                staging.mkdir(exist_ok=True)
                snap.write(staging)
            _write_json_atomic(
                staging / "version.json",
                {"version": v, "kind": "full" if full else "delta", "base": self.version},
            )
            _fsync_dir(staging)
            os.rename(staging, final)
            (self.root / ".LATEST.tmp").write_text(str(v))
            os.replace(self.root / ".LATEST.tmp", self.root / "LATEST")
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._snapshot, self.version = snap, v
        return PublishReport(
            version=v,
            path=final,
            kind="full" if full else "delta",
            delta=delta,
            full_bytes=sum(e.nbytes for e in snap.tensors.values()),
            seconds=time.perf_counter() - t0,
        )


@dataclass(frozen=True, slots=True)
class PullReport:
    """What ``DeltaSubscriber.pull`` did.

    Attributes:
        version: the version now materialized locally.
        path: its local checkpoint directory.
        previous: the version held before (``None`` if none).
        steps: how it got there, e.g. ``["full 10", "delta 11", "delta 12"]``.
        changed: names of the tensors that differ from the previous local version (all
            tensors after a full copy).
        seconds: wall time.
    """

    version: int
    path: Path
    previous: int | None
    steps: tuple[str, ...]
    changed: tuple[str, ...]
    seconds: float


class DeltaSubscriber:
    """Keep a local, materialized HF checkpoint up to date with a publish root.

    Each pulled version becomes its own directory ``local_root/weight_v{N:06d}/`` (written
    under a hidden name, then renamed), so the engine can keep serving the old one until it
    reloads; the ``keep`` newest are kept. Catching up several versions applies their deltas
    in one pass and writes only the newest.

    Args:
        publish_root: the ``DeltaPublisher`` root.
        local_root: where local versions are materialized (the engine host's disk).
        keep: how many local versions to keep (>= 2: the served one and the new one).
        max_chain: the most deltas to apply in one pull; a host further behind (or one that
            holds nothing yet, or whose chain the publisher pruned) copies the newest full
            snapshot instead and applies the deltas after it. ``None``: no limit.
    """

    def __init__(
        self,
        publish_root: str | Path,
        local_root: str | Path,
        *,
        keep: int = 2,
        max_chain: int | None = None,
    ) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (the served version and the new one), got {keep}")
        self.publish_root = Path(publish_root)
        self.local_root = Path(local_root)
        self.local_root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.max_chain = max_chain

    def _local_versions(self) -> list[int]:
        found = [_VERSION_RE.match(p.name) for p in self.local_root.iterdir() if p.is_dir()]
        return sorted(int(m.group(1)) for m in found if m)

    @property
    def version(self) -> int | None:
        """The newest locally materialized version."""
        local = self._local_versions()
        return local[-1] if local else None

    def path(self, version: int | None = None) -> Path:
        """The local directory of a version (default: the newest)."""
        v = self.version if version is None else version
        if v is None:
            raise ValueError(f"{self.local_root} holds no version yet; call pull() first")
        return self.local_root / version_dir_name(v)

    def latest_published(self) -> int | None:
        """The publisher's ``LATEST`` version."""
        return read_latest(self.publish_root)

    def _kind(self, v: int) -> str:
        return version_kind(self.publish_root, v)

    def _is_full(self, v: int) -> bool:
        meta = self.publish_root / version_dir_name(v) / "version.json"
        return meta.is_file() and self._kind(v) == "full"

    def prune(self) -> list[int]:
        """Delete all but the ``keep`` newest local versions; return the versions deleted."""
        gone = self._local_versions()[: -self.keep]
        for old in gone:
            shutil.rmtree(self.local_root / version_dir_name(old))
        return gone

    def pull(self, version: int | None = None) -> PullReport:
        """Materialize the latest (or a given) published version locally.

        Raises:
            ValueError: nothing published, a version missing, or a delta refused (the local
                versions are left as they were).
        """
        t0 = time.perf_counter()
        target = self.latest_published() if version is None else version
        if target is None:
            raise ValueError(f"{self.publish_root}: nothing published yet (no LATEST)")
        have = self.version
        steps: list[str] = []
        changed: set[str] = set()
        if have is not None and have > target:
            raise ValueError(f"local version {have} is newer than the requested {target}")
        start = have
        chain_ok = have is not None and (self.max_chain is None or target - have <= self.max_chain)
        if chain_ok:
            chain_ok = all(
                (self.publish_root / version_dir_name(v) / "version.json").is_file()
                for v in range(have + 1, target + 1)  # type: ignore[operator]
            )
        if not chain_ok:
            fulls = [v for v in range(target + 1) if self._is_full(v)]
            if not fulls:
                raise ValueError(f"{self.publish_root}: no full snapshot at or before {target}")
            f = fulls[-1]
            src = self.publish_root / version_dir_name(f)
            staging = self.local_root / f".{version_dir_name(f)}.tmp-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(src, staging, ignore=shutil.ignore_patterns("delta", "version.json"))
            if (self.local_root / version_dir_name(f)).exists():
                shutil.rmtree(self.local_root / version_dir_name(f))
            os.rename(staging, self.local_root / version_dir_name(f))
            steps.append(f"full {f}")
            with CheckpointIndex(self.local_root / version_dir_name(f)) as idx:
                changed.update(idx.tensors)
            start = f
        assert start is not None
        deltas = []
        for v in range(start + 1, target + 1):
            d = self.publish_root / version_dir_name(v)
            deltas.append(d / "delta" if self._kind(v) == "full" else d)
            steps.append(f"delta {v}")
        if deltas:  # one pass: only the target version is written
            rep = materialize_chain(
                self.local_root / version_dir_name(start),
                deltas,
                self.local_root / version_dir_name(target),
            )
            changed.update(rep.changed)
        self.prune()
        return PullReport(
            version=target,
            path=self.local_root / version_dir_name(target),
            previous=have,
            steps=tuple(steps),
            changed=tuple(sorted(changed)),
            seconds=time.perf_counter() - t0,
        )
