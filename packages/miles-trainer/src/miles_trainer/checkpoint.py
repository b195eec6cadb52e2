"""Trainer checkpoints for resume: the whole training state in one directory, written atomically.

Layout of a checkpoint directory (``trainer.save_checkpoint(path, step=...)``)::

    meta.json          format, version, backend, step, model fingerprint, layout, file sizes
    hf/                config.json, generation_config.json, tokenizer files (for export_hf)
    rng/rank<r>.pt     rank r's RNG states: torch CPU, CUDA, python ``random``, numpy
    client_state.pt    the caller's object (rank 0's), when one was given
    fsdp/              FSDP2: torch.distributed.checkpoint of model, optimizer, critic
    megatron/          Megatron: model_rank<r>.pt and optim_rank<r>.pt per rank

Every rank writes into a temp directory beside ``path``; once all succeeded, rank 0 writes
``meta.json`` last (with the size of every file) and renames the directory into place. A
directory without a valid ``meta.json`` or with a file of another size is torn and refused,
as is a checkpoint of another model, backend or layout (`read_meta`).

Also here: `latest_checkpoint` / `prune_checkpoints` (retention), `export_hf` (an HF model
directory of the policy from any checkpoint, in one process, no trainer needed; also
``python -m miles_trainer.checkpoint export-hf CKPT OUT``) and `set_deterministic`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import errno
import json
import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_trainer._hf_dir import TOKENIZER_FILES

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "export_hf",
    "latest_checkpoint",
    "model_fingerprint",
    "prune_checkpoints",
    "read_meta",
    "set_deterministic",
    "write_checkpoint",
]

FORMAT = "miles-trainer-checkpoint"
VERSION = 1
META = "meta.json"
# What identifies a model's architecture (two checkpoints of one model agree on all of them).
_ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "tie_word_embeddings",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: torn, foreign, or of another model or layout."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What `load_checkpoint` restored.

    Attributes:
        path: the checkpoint directory.
        step: the step the caller passed to ``save_checkpoint``.
        backend: "fsdp" or "megatron".
        client_state: the object the caller passed to ``save_checkpoint`` (None if none).
        created: when it was written (ISO 8601, UTC).
    """

    path: Path
    step: int
    backend: str
    client_state: Any
    created: str


def model_fingerprint(hf_config: Any) -> dict[str, Any]:
    """The architecture fields of an HF config (absent ones as None)."""
    return {k: getattr(hf_config, k, None) for k in _ARCH_FIELDS}


def set_deterministic(device: torch.device) -> None:
    """Deterministic kernels for this process (``TrainerConfig.deterministic``).

    ``torch.use_deterministic_algorithms(True)``; on CUDA also ``CUBLAS_WORKSPACE_CONFIG``
    (cuBLAS reads it when it first runs, so this must precede the first matmul).
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, python, numpy)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the trainer
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# ---------------------------------------------------------------------- writing


def _all_ok(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_tree(root: Path) -> dict[str, int]:
    """fsync every file under ``root``; return their sizes by relative path."""
    sizes = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sizes[p.relative_to(root).as_posix()] = p.stat().st_size
    return sizes


def _write_hf_files(dst: Path, hf_config: Any, source_dir: str) -> None:
    dst.mkdir()
    hf_config.save_pretrained(dst)
    src = Path(source_dir)
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def write_checkpoint(
    path: str | os.PathLike[str],
    *,
    device: torch.device,
    backend: str,
    step: int,
    hf_config: Any,
    source_dir: str,
    layout: Mapping[str, Any],
    extra_meta: Mapping[str, Any],
    client_state: Any,
    write_state: Callable[[Path], None],
) -> Path:
    """Write a checkpoint directory atomically. Collective: every rank calls it.

    Args:
        path: the directory (on a filesystem every rank sees); an existing one is replaced.
        device: this rank's device (for the collectives).
        backend: the backend's name, recorded and checked at load.
        step: the caller's step, recorded.
        hf_config: the policy's HF config (fingerprint, and ``hf/config.json`` for export).
        source_dir: the model directory the trainer loaded (tokenizer files are copied).
        layout: the parallel layout; a checkpoint loads only into the same one.
        extra_meta: backend facts recorded in ``meta.json`` (JSON-serialisable).
        client_state: an object to store (rank 0's is written; pickled), or None.
        write_state: ``write_state(tmp_dir)`` writes this rank's share of the state
            (collective inside as the backend needs).

    Returns:
        The final path.

    Raises:
        RuntimeError: on every rank when some rank failed (its own error on that rank); the
            temp directory is removed and an existing checkpoint at ``path`` is kept.
    """
    out = Path(path).absolute()
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp_name: str | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp_name = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)
        except BaseException as e:
            error = e
    tmp_name = _broadcast(tmp_name)
    if tmp_name is None:  # rank 0 could not create it
        if error is not None:
            raise error
        raise RuntimeError(f"rank 0 could not create a temp directory beside {out}")
    tmp = Path(tmp_name)
    try:
        write_state(tmp)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")
        if rank == 0:
            _write_hf_files(tmp / "hf", hf_config, source_dir)
            if client_state is not None:
                torch.save(client_state, tmp / "client_state.pt")
    except BaseException as e:
        error = _disk_full_as_oserror(e, tmp, out)
    if not _all_ok(error is None, device):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(f"another rank failed to write the checkpoint {out}; nothing written")
    if rank == 0:
        try:
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "backend": backend,
                "step": int(step),
                "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "model": model_fingerprint(hf_config),
                "layout": dict(layout),
                **dict(extra_meta),
                "files": _fsync_tree(tmp),
            }
            (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
            fd = os.open(tmp / META, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _replace_dir(tmp, out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
    if not _all_ok(error is None, device):
        if error is not None:
            raise error
        raise RuntimeError(f"rank 0 failed to finish the checkpoint {out}; nothing written")
    return out


def _error_text(error: BaseException) -> str:
    """The error's text with its causes' and, for torch.distributed.checkpoint's
    ``CheckpointException``, each rank's failure."""
    parts = [str(error)]
    for failure in (getattr(error, "failures", None) or {}).values():  # rank -> (exc, trace)
        parts.append(str(failure[0] if isinstance(failure, tuple) else failure))
    cause = error.__cause__ or error.__context__
    if cause is not None and cause is not error:
        parts.append(str(cause))
    return "\n".join(parts)


def _disk_full_as_oserror(error: BaseException, tmp: Path, out: Path) -> BaseException:
    """``torch.save`` reports a full disk as ``RuntimeError(... unexpected pos ...)``: its zip
    writer sees a short write and loses the ENOSPC (under torch.distributed.checkpoint, wrapped
    in a ``CheckpointException`` per rank). Give it back as the ``OSError(ENOSPC)`` it is,
    naming the directory, so callers print one line with the fix (seen on a full tmpfs:
    tools/reliability_table.py, row full-disk)."""
    if isinstance(error, KeyboardInterrupt | SystemExit) or "unexpected pos" not in _error_text(
        error
    ):
        return error
    try:
        free: int | str = shutil.disk_usage(tmp).free
    except OSError:
        free = "unknown"
    full = OSError(
        errno.ENOSPC,
        f"no space left on the disk of {out.parent} (or a quota) while writing the checkpoint "
        f"{out.name} ({free} bytes free after the failed write; nothing was written, earlier "
        "checkpoints are intact; run.keep_checkpoints keeps fewer)",
    )
    full.__cause__ = error
    return full


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` (an existing ``out`` is replaced) and fsync the parent."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- reading


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of a complete checkpoint (every file present with its recorded size).

    Raises:
        CheckpointError: not a directory, not a miles-trainer checkpoint, a newer format, or
            torn (no ``meta.json``, or a file missing or of another size), naming the problem.
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} is not a directory")
    meta_path = p / META
    if not meta_path.is_file():
        raise CheckpointError(
            f"checkpoint {p} has no {META}: it is torn (its writer stopped before finishing) "
            "or not a miles-trainer checkpoint; resume from an earlier one "
            "(miles_trainer.checkpoint.latest_checkpoint skips torn ones)"
        )
    try:
        meta: dict[str, Any] = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {p}: {META} is unreadable ({e}): it is torn") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {p} is not a miles-trainer checkpoint ({META} has format "
            f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r})"
        )
    if int(meta.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"checkpoint {p} has format version {meta['version']}; this miles-trainer reads up "
            f"to {VERSION}: upgrade miles-trainer"
        )
    for rel, size in meta.get("files", {}).items():
        f = p / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {p} is torn: {rel} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {p} is torn: {rel} has {f.stat().st_size} bytes, {size} were written"
            )
    return meta


def check_compatible(
    meta: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    backend: str,
    hf_config: Any,
    layout: Mapping[str, Any],
) -> None:
    """Refuse a checkpoint of another backend, model or parallel layout.

    Raises:
        CheckpointError: naming what differs and what to do.
    """
    if meta["backend"] != backend:
        raise CheckpointError(
            f"checkpoint {path} was written by the {meta['backend']} backend; this trainer is "
            f"{backend}: resume with trainer.backend: {meta['backend']}, or start a new run from "
            "its weights (miles_trainer.export_hf)"
        )
    want = model_fingerprint(hf_config)
    have = meta.get("model", {})
    diff = [
        f"{k}: checkpoint {have.get(k)!r}, model {want[k]!r}"
        for k in want
        if have.get(k) != want[k]
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint {path} is of another model ({'; '.join(diff)}): load it into a trainer "
            "of the same model"
        )
    saved = meta.get("layout", {})
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}"
        for k, v in layout.items()
        if saved.get(k) != v
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint {path} was written with another layout ({'; '.join(diff)}): resume with "
            "the same layout and number of processes, or start a new run from its weights "
            "(miles_trainer.export_hf)"
        )


def load_common(path: str | os.PathLike[str], meta: Mapping[str, Any]) -> CheckpointInfo:
    """Restore this rank's RNG states and read the client state; return the `CheckpointInfo`.

    Call it last in a load: the process continues from the RNG states it had when it saved.
    """
    p = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    set_rng_state(torch.load(p / "rng" / f"rank{rank}.pt", weights_only=False))
    client = None
    if (p / "client_state.pt").is_file():
        client = torch.load(p / "client_state.pt", weights_only=False)
    return CheckpointInfo(
        path=p,
        step=int(meta["step"]),
        backend=str(meta["backend"]),
        client_state=client,
        created=str(meta.get("created", "")),
    )


# ---------------------------------------------------------------------- retention


def _step_of(p: Path) -> int | None:
    try:
        meta = json.loads((p / META).read_text())
        return int(meta["step"]) if meta.get("format") == FORMAT else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(parent: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step among ``parent``'s subdirectories (torn
    ones and temp directories are skipped), or None."""
    best: tuple[int, Path] | None = None
    root = Path(parent)
    if not root.is_dir():
        return None
    for p in root.iterdir():
        if not p.is_dir() or p.name.startswith("."):
            continue
        step = _step_of(p)
        if step is None:
            continue
        try:
            read_meta(p)
        except CheckpointError:
            continue
        if best is None or step > best[0]:
            best = (step, p)
    return None if best is None else best[1]


def prune_checkpoints(parent: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints in ``parent`` (by step), plus temp
    directories left by interrupted writes. Only miles-trainer checkpoints are touched. Call
    it on one rank (rank 0) after `write_checkpoint` returned.

    Returns:
        The deleted checkpoint directories.

    Raises:
        ValueError: ``keep`` < 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
    root = Path(parent)
    found = sorted(
        ((s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None),
        key=lambda sp: sp[0],
    )
    gone = [p for _, p in found[: max(0, len(found) - keep)]]
    for p in gone:
        shutil.rmtree(p)
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)
    return gone


# ---------------------------------------------------------------------- HF export


def export_hf(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | None = None,
) -> Path:
    """Write the policy of a trainer checkpoint as a Hugging Face model directory.

    Runs in one process without a trainer or process group; reads only the model weights. The
    output is what ``save_hf_checkpoint`` of the trainer that wrote the checkpoint would have
    written at that step (same names and values).

    Args:
        checkpoint_dir: a checkpoint written by ``save_checkpoint`` (FSDP2 or Megatron).
        out_dir: the HF directory to write (atomically; an existing one is replaced).
        dtype: weight dtype ("float32", "bfloat16", "float16"); default the trainer's
            compute dtype.

    Returns:
        The output directory.

    Raises:
        CheckpointError: a torn or foreign checkpoint.
        ValueError: an unknown dtype.
    """
    from transformers import AutoConfig

    from miles_trainer._hf_dir import write_hf_dir

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    ckpt = Path(checkpoint_dir)
    meta = read_meta(ckpt)
    name = dtype or meta.get("dtype", "float32")
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {tuple(dtypes)}, got {name!r}")
    if meta["backend"] == "fsdp":
        from miles_trainer.fsdp import train_state
    else:
        from miles_trainer.megatron import train_state  # type: ignore[no-redef]
    state = train_state.read_model_state(ckpt, meta)
    config = AutoConfig.from_pretrained(ckpt / "hf")
    return write_hf_dir(
        out_dir,
        state,
        config=config,
        generation_config=None,
        source_dir=str(ckpt / "hf"),
        dtype=dtypes[name],
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m miles_trainer.checkpoint export-hf CKPT OUT [--dtype D]`` and ``latest``."""
    parser = argparse.ArgumentParser(prog="python -m miles_trainer.checkpoint")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export-hf", help="write the policy of a checkpoint as an HF directory")
    ex.add_argument("checkpoint")
    ex.add_argument("out")
    ex.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    la = sub.add_parser("latest", help="print the newest complete checkpoint in a directory")
    la.add_argument("parent")
    args = parser.parse_args(argv)
    if args.cmd == "export-hf":
        print(export_hf(args.checkpoint, args.out, dtype=args.dtype))
    else:
        found = latest_checkpoint(args.parent)
        if found is None:
            raise SystemExit(f"no complete checkpoint in {args.parent}")
        print(found)


if __name__ == "__main__":
    main()
