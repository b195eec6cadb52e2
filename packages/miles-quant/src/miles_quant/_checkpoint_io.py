"""Streaming safetensors I/O for checkpoint conversion: read one tensor at a time, write
bounded shards, and make the output directory appear atomically.

safetensors is an optional dependency of miles-quant (the ``checkpoint`` extra); it is imported
here, on first use, with an ImportError that names the install command.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

# Files that hold weights (never copied as side files; the writer produces its own).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Rewritten by the exporter (config.json) or describing a quantization the source may carry.
REWRITTEN_FILES = ("config.json", "hf_quant_config.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise ImportError(
            "miles_quant.checkpoint needs safetensors: pip install 'miles-quant[checkpoint]' "
            "(or pip install safetensors)"
        ) from e
    return safetensors


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory, in index order.

    Raises:
        FileNotFoundError: the directory, its config.json or its safetensors weights are missing.
    """
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{os.fspath(model_dir)!r} is not a directory (an HF model dir)")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{os.fspath(model_dir)!r} has no config.json")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = list(dict.fromkeys(_weight_map(index).values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{os.fspath(index)} names shard(s) that do not exist: {missing[:3]}"
            )
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    hint = ""
    if any(model_dir.glob("pytorch_model*.bin")):
        hint = " (found pytorch_model*.bin: re-save the model with save_pretrained)"
    raise FileNotFoundError(
        f"{os.fspath(model_dir)!r} has no model.safetensors or model.safetensors.index.json{hint}"
    )


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index, checked: ``{tensor name: shard file}``.

    Raises:
        ValueError: not JSON, or no ``weight_map`` object of strings (names the file and field).
    """
    fix = "write the checkpoint again with save_pretrained, or delete the index of a one-file model"
    try:
        data = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{os.fspath(index)} is not valid JSON ({e}); {fix}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{os.fspath(index)} has no 'weight_map' object (tensor name -> shard file); {fix}"
        )
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or "/" in v or v == ".."]
    if bad:
        raise ValueError(
            f"{os.fspath(index)}: weight_map[{bad[0]!r}] = {weight_map[bad[0]]!r} is not a shard "
            f"file name in this directory; {fix}"
        )
    return weight_map


class TensorReader:
    """Lazy access to every tensor of a model directory; nothing is loaded until asked for.

    Use as a context manager; `names` lists tensors in file order, `get` loads one.
    """

    def __init__(self, model_dir: Path) -> None:
        self._files = weight_files(model_dir)
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        self.names: list[str] = []
        self.metadata: dict[str, str] = {}

    def __enter__(self) -> TensorReader:
        st = _safetensors()
        try:
            for f in self._files:
                try:
                    handle = self._stack.enter_context(st.safe_open(str(f), framework="pt"))
                except (st.SafetensorError, OSError) as e:
                    raise ValueError(
                        f"{os.fspath(f)} is not a readable safetensors file ({e}); it is "
                        "truncated or corrupt: write the checkpoint again or copy it again"
                    ) from None
                self.metadata.update(handle.metadata() or {})
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in self._where:
                        raise ValueError(f"tensor {name!r} appears in two weight files")
                    self._where[name] = handle
                    self.names.append(name)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def meta(self, name: str) -> tuple[list[int], torch.dtype | None]:
        """(shape, dtype) from the header, without loading; dtype None for non-float."""
        sl = self._where[name].get_slice(name)
        return list(sl.get_shape()), _FLOAT_DTYPES.get(sl.get_dtype())

    def __contains__(self, name: object) -> bool:
        return name in self._where


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own), then an index when there is more than one shard."""

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self._dir = out_dir
        self._max = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} written twice (a name clash in the layout)")
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self._max:
            self._flush()
        self._pending[name] = t.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        st = _safetensors()
        fname = f"part-{len(self._shards):05d}.safetensors"
        st.torch.save_file(self._pending, str(self._dir / fname), metadata={"format": "pt"})
        self._shards.append((fname, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> list[str]:
        """Flush, give shards their final names; return the file names written."""
        self._flush()
        if not self._shards:  # an empty model still gets a (valid, empty) file
            _safetensors().torch.save_file({}, str(self._dir / "model.safetensors"))
            return ["model.safetensors"]
        n = len(self._shards)
        if n == 1:
            (self._dir / self._shards[0][0]).rename(self._dir / "model.safetensors")
            return ["model.safetensors"]
        weight_map: dict[str, str] = {}
        out = []
        for k, (tmp_name, names) in enumerate(self._shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            (self._dir / tmp_name).rename(self._dir / final)
            weight_map.update(dict.fromkeys(names, final))
            out.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self._dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return out


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer, generation config and other small files of ``src`` (top level, not
    weights, not config.json); return their names."""
    copied = []
    for p in sorted(src.iterdir()):
        name = p.name
        if not p.is_file() or name.startswith("."):
            continue
        if name.endswith(WEIGHT_SUFFIXES) or name in INDEX_FILES or name in REWRITTEN_FILES:
            continue
        shutil.copy2(p, dst / name)
        copied.append(name)
    return copied


def check_destination(dst: Path, src: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise ValueError(f"the output directory must differ from the source ({os.fspath(src)!r})")
    if dst.exists() and not overwrite:
        raise FileExistsError(
            f"{os.fspath(dst)!r} exists; pass overwrite=True (CLI: --overwrite) to replace it"
        )


class AtomicDir:
    """A temp dir next to the target; `commit` renames it into place (replacing an old one).

    On any error before `commit` the temp dir is removed and the target is left untouched.
    """

    def __init__(self, target: Path) -> None:
        self.target = target.absolute()
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(
            tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=self.target.parent)
        )
        self._committed = False

    def commit(self) -> None:
        old = None
        if self.target.exists():
            old = self.target.parent / f".{self.target.name}.old-{uuid.uuid4().hex[:8]}"
            self.target.rename(old)
        try:
            self.tmp.rename(self.target)
        except BaseException:
            if old is not None:
                old.rename(self.target)
            raise
        self._committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def __enter__(self) -> AtomicDir:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            shutil.rmtree(self.tmp, ignore_errors=True)


def iter_tensors(reader: TensorReader, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        yield name, reader.get(name)
