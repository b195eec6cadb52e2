"""The SGLang backend: the ``python -m sglang.launch_server`` command line of each engine.

Flags pass straight through (``sglang_args={"tp_size": 2}``, or ``--sglang-tp-size 2`` on the
fleet's command line, becomes ``--tp-size 2``); the fleet sets only the model, the address,
``--dp-size`` and, when several engines share the machine's GPUs, ``--base-gpu-id``.
SGLang itself cannot run on the CPU machines: this module only builds argument lists (tested
on CPU); ``tools/gpu_checks/sglang_fleet_check.sh`` runs a fleet of SGLang engines on a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "SGLANG_QUANTIZATION",
    "cli_flags",
    "gpus_per_engine",
    "parse_passthrough",
    "quantization_args",
    "sglang_argv",
]

# EngineConfig.weight_format -> SGLang's --quantization. SGLang quantizes a BF16 checkpoint
# online for fp8 and mxfp8 ("MOE + linear online quantization" in its server_args); nvfp4,
# mxfp4 and int4 are loaded from a checkpoint in the layout miles-quant exports
# (miles_quant.checkpoint.export_checkpoint: ModelOpt NVFP4, gpt-oss MXFP4 - MoE only in
# SGLang -, compressed-tensors W4A16), whose ignore list carries the layers kept in BF16
# (export with the engine's keep_bf16 / keep_first_layers / keep_last_layers). A DeepSeek FP8
# export's weight_block_size gives fp8_block128's 128x128 blocks.
SGLANG_QUANTIZATION: dict[str, str] = {
    "fp8_block128": "fp8",
    "mxfp8": "mxfp8",
    "mxfp8_e4m3": "mxfp8",
    "nvfp4": "modelopt_fp4",
    "mxfp4": "mxfp4",
    "int4_g32": "compressed-tensors",
    "int4_g128": "compressed-tensors",
}
_PLAIN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def cli_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"tp_size": 2, "enable_x": True, "off": False, "many": [1, 2]}`` ->
    ``["--tp-size", "2", "--enable-x", "--many", "1", "2"]`` (``False``/``None``: left out)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_passthrough(tokens: Sequence[str], prefix: str) -> dict[str, Any]:
    """Collect ``--<prefix>NAME [VALUE...]`` command-line tokens into ``{"name": value}``.

    A flag with no value is ``True``, one value a string, several a list:
    ``["--sglang-tp-size", "2", "--sglang-enable-dp-attention"]`` with prefix ``"sglang-"`` ->
    ``{"tp_size": "2", "enable_dp_attention": True}``.

    Raises:
        ValueError: a token that is neither such a flag nor a value following one.
    """
    out: dict[str, Any] = {}
    key: str | None = None
    values: list[str] = []

    def flush() -> None:
        if key is not None:
            out[key] = True if not values else values[0] if len(values) == 1 else list(values)

    for tok in tokens:
        if tok.startswith("--"):
            name = tok[2:]
            if "=" in name:
                name, value = name.split("=", 1)
            else:
                value = None
            if not name.startswith(prefix) or name == prefix:
                raise ValueError(
                    f"unrecognized argument {tok!r} (engine flags pass as --{prefix}NAME)"
                )
            flush()
            key, values = name[len(prefix) :].replace("-", "_"), []
            if value is not None:
                values.append(value)
        elif key is None:
            raise ValueError(f"unrecognized argument {tok!r}")
        else:
            values.append(tok)
    flush()
    return out


def quantization_args(weight_format: str | None) -> dict[str, Any]:
    """SGLang flags (as ``sglang_args``) that serve ``weight_format`` (an
    ``EngineConfig.weight_format``): ``{"dtype": ..., "quantization": ...}``; ``{}`` for None.

    Raises:
        ValueError: a format with no SGLang counterpart (naming the ones there are).
    """
    if weight_format is None:
        return {}
    if weight_format in _PLAIN_DTYPES:
        return {"dtype": _PLAIN_DTYPES[weight_format]}
    if weight_format not in SGLANG_QUANTIZATION:
        raise ValueError(
            f"weight_format {weight_format!r} has no SGLang quantization; choose one of "
            f"{[*_PLAIN_DTYPES, *SGLANG_QUANTIZATION]}"
        )
    return {"dtype": "bfloat16", "quantization": SGLANG_QUANTIZATION[weight_format]}


def gpus_per_engine(sglang_args: Mapping[str, Any], dp_size: int) -> int:
    """GPUs one SGLang engine occupies: ``tp_size`` with DP attention (the DP ranks share the
    TP group's GPUs), else ``tp_size * dp_size`` (SGLang's data-parallel controller starts
    ``dp_size`` TP groups)."""
    tp = int(sglang_args.get("tp_size", sglang_args.get("tp", 1)))
    return tp if sglang_args.get("enable_dp_attention") else tp * dp_size


def sglang_argv(
    *,
    index: int,
    model_path: str,
    host: str,
    port: int,
    dp_size: int,
    sglang_args: Mapping[str, Any],
    python: str | None = None,
    weight_format: str | None = None,
) -> list[str]:
    """The command line of engine ``index``.

    Engine ``i`` starts at GPU ``i * gpus_per_engine(...)`` (``--base-gpu-id``) unless
    ``sglang_args`` sets ``base_gpu_id`` (or the caller gives each engine its own
    ``CUDA_VISIBLE_DEVICES``). ``weight_format`` adds :func:`quantization_args`.

    Raises:
        ValueError: ``sglang_args`` sets ``quantization`` or ``dtype`` differently from what
            ``weight_format`` needs.
    """
    quant = quantization_args(weight_format)
    for key, value in quant.items():
        if key in sglang_args and str(sglang_args[key]) != value:
            raise ValueError(
                f"sglang_args sets {key}={sglang_args[key]!r} but weight_format "
                f"{weight_format!r} needs {key}={value!r}; drop one of them"
            )
    argv = [python or sys.executable, "-m", "sglang.launch_server"]
    argv += ["--model-path", model_path, "--host", host, "--port", str(port)]
    if dp_size > 1:
        argv += ["--dp-size", str(dp_size)]
    args = {**quant, **sglang_args}
    if "base_gpu_id" not in args and index > 0:
        args["base_gpu_id"] = index * gpus_per_engine(args, dp_size)
    return argv + cli_flags(args)
