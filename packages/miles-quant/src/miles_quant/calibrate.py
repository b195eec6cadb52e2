"""Activation calibration: static input scales for NVFP4 (ModelOpt ``input_scale``) and FP8.

An NVFP4 GEMM quantizes its activations on the fly with a per-tensor global scale that the
checkpoint fixes in advance: ModelOpt's ``input_scale`` = activation amax / (448 * 6), an fp32
scalar per Linear module (engines take the max over modules fused into one GEMM, such as
q/k/v, and use ``1 / input_scale`` to quantize, ``input_scale * weight_scale_2`` as the GEMM's
alpha). This module measures that amax: it runs a model over calibration batches with forward
pre-hooks on its ``torch.nn.Linear`` modules and records, per module, the largest ``|x|`` of
any input over all batches. Fused MoE experts (transformers' ``mlp.experts`` with 3-D
``gate_up_proj`` / ``down_proj``) are recorded per expert, under the names engines load.

    from miles_quant.calibrate import calibrate_checkpoint, read_prompts
    from miles_quant.checkpoint import export_checkpoint
    cal = calibrate_checkpoint("qwen3-bf16", read_prompts("calib.jsonl", limit=128))
    export_checkpoint("qwen3-bf16", "qwen3-nvfp4", "nvfp4", input_amax=cal.amax)

`collect_input_amax` works on any module (a plain HF model, batches of your own);
`calibrate_checkpoint` loads an HF checkpoint and its tokenizer (needs transformers:
``pip install 'miles-quant[calibrate]'``). The rule is in docs/contract.md (section 4, NVFP4).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_quant._calibrate_experts import ExpertSpy, eager_experts, fused_expert_slices
from miles_quant._checkpoint_select import _check_pattern, check_pattern_list, matches

__all__ = [
    "INPUT_SCALE_DIVISORS",
    "Calibration",
    "calibrate_checkpoint",
    "collect_input_amax",
    "input_scale",
    "read_prompts",
]

# input_scale = amax / divisor: the largest element times the largest scale code it is
# combined with. NVFP4: E2M1 max 6 times the E4M3 block-scale max 448 (ModelOpt); FP8 E4M3
# per-tensor static activation scale: 448.
INPUT_SCALE_DIVISORS: dict[str, float] = {"nvfp4": 448.0 * 6.0, "fp8_e4m3": 448.0}


@dataclass(slots=True)
class Calibration:
    """What `collect_input_amax` measured.

    Attributes:
        amax: Linear module name -> the largest ``|x|`` over every input it received, an fp32
            value (held as a Python float, exactly). Pass it as ``input_amax=`` to
            `miles_quant.checkpoint.export_checkpoint`.
        batches: number of calibration batches run.
        unused: selected Linear modules that never received an input (say, MoE experts no
            token was routed to); they have no entry in ``amax``.
    """

    amax: dict[str, float] = field(default_factory=dict)
    batches: int = 0
    unused: list[str] = field(default_factory=list)

    def input_scales(self, fmt: str = "nvfp4") -> dict[str, torch.Tensor]:
        """``input_scale(amax, fmt)`` for every module in ``amax``."""
        return {name: input_scale(a, fmt) for name, a in self.amax.items()}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``amax`` as a JSON object (the CLI's ``--input-amax`` file); exact floats."""
        out = Path(path)
        out.write_text(json.dumps(self.amax, indent=1, sort_keys=True) + "\n")
        return out


def input_scale(amax: float | torch.Tensor, fmt: str = "nvfp4") -> torch.Tensor:
    """The static activation scale of one module: ``fp32(amax) / divisor`` in fp32.

    Args:
        amax: the activation amax (rounded to fp32 first, as ModelOpt keeps it).
        fmt: "nvfp4" (divisor 448 * 6 = 2688: ModelOpt's NVFP4 ``input_scale``) or "fp8_e4m3"
            (divisor 448: a per-tensor static FP8 activation scale).

    Returns:
        A float32 scalar tensor: the dequantization multiplier engines store as
        ``input_scale`` (they quantize activations with ``1 / input_scale``).

    Raises:
        ValueError: an unknown ``fmt``, or an amax that is not finite and > 0.
    """
    if fmt not in INPUT_SCALE_DIVISORS:
        raise ValueError(
            f"no static input scale for format {fmt!r}; choose one of "
            f"{sorted(INPUT_SCALE_DIVISORS)}"
        )
    a = torch.as_tensor(amax).detach().to(device="cpu", dtype=torch.float32).reshape(())
    if not (torch.isfinite(a) and a > 0):
        raise ValueError(
            f"an activation amax must be finite and > 0 to give an input scale, got {float(a)}; "
            "calibrate on data that reaches the module (or keep it unquantized)"
        )
    return a / INPUT_SCALE_DIVISORS[fmt]


def _selector(modules: Sequence[str] | None, skip: Sequence[str]) -> Callable[[str], bool]:
    check_pattern_list(modules, "modules")
    check_pattern_list(skip, "skip")
    for p in (*(modules or ()), *skip):
        _check_pattern(p)

    def selected(name: str) -> bool:
        if modules is not None and not any(matches(name, p) for p in modules):
            return False
        return not any(matches(name, p) for p in skip)

    return selected


def _run(model: torch.nn.Module, batch: Any) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def collect_input_amax(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    modules: Sequence[str] | None = None,
    skip: Sequence[str] = ("lm_head",),
) -> Calibration:
    """Run ``model`` over ``batches`` and record each Linear module's input amax.

    A forward pre-hook on every selected ``torch.nn.Linear`` takes ``|x|.amax()`` of its input
    (exact in the input's dtype, then widened to fp32) on every call; a module's amax is the
    max over all calls and batches. Fused MoE experts (a module with 3-D ``gate_up_proj`` and
    ``down_proj``, as transformers keeps Qwen2/3-MoE and DeepSeek experts) are recorded per
    expert under the names engines load (``...mlp.experts.{e}.gate_proj``, ``up_proj``,
    ``down_proj``), from the inputs of each expert's ``F.linear`` (the experts run their eager
    loop meanwhile). The model runs under ``torch.no_grad()``; its parameters and mode are not
    changed (put it in eval mode yourself); hooks and settings are restored on return and on
    error.

    Args:
        model: any module, e.g. an HF causal LM.
        batches: each item is passed as ``model(**b)`` (a mapping, e.g. ``{"input_ids": ...}``),
            ``model(*b)`` (a tuple or list) or ``model(b)``.
        modules: patterns (globs on module names, or "re:" + a regex) selecting the Linear
            modules (and per-expert names) to record; default all of them.
        skip: patterns of Linear modules not to hook (default ``lm_head``, never quantized).

    Returns:
        A `Calibration` (``amax`` per module that received input).

    Raises:
        ValueError: no Linear module or expert selected; no batch at all; a module's input
            holds NaN or Inf (the message names the module and the batch).
    """
    selected = _selector(modules, skip)
    linears = [
        (n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and selected(n)
    ]
    slices = fused_expert_slices(model, selected)
    targets = [n for n, _ in linears] + [n for _, names in slices.values() for n in names]
    if not targets:
        raise ValueError(
            f"no torch.nn.Linear module (or fused MoE expert) of the model is selected "
            f"(modules={list(modules or [])} skip={list(skip)}); check the patterns (globs on "
            "module names such as '*.mlp.*', or 're:' + a regex)"
        )
    amax: dict[str, torch.Tensor] = {}
    state = {"batch": 0}

    def record(name: str, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        a = x.detach().abs().amax().float().cpu()
        if not torch.isfinite(a):
            raise ValueError(
                f"the input of {name} holds NaN or Inf in calibration batch {state['batch']}; "
                "an amax (and so input_scale) would be meaningless: fix the model or data"
            )
        prev = amax.get(name)
        amax[name] = a if prev is None else torch.maximum(prev, a)

    def hook_for(name: str) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor):
                record(name, x)

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in linears]
    spy = ExpertSpy(slices, record) if slices else contextlib.nullcontext()
    try:
        with torch.no_grad(), eager_experts(model), spy:
            for batch in batches:
                _run(model, batch)
                state["batch"] += 1
    finally:
        for h in handles:
            h.remove()
    if state["batch"] == 0:
        raise ValueError(
            "empty calibration set: no batch was given; pass at least one batch of inputs"
        )
    return Calibration(
        amax={n: float(amax[n]) for n in targets if n in amax},
        batches=state["batch"],
        unused=[n for n in targets if n not in amax],
    )


def read_prompts(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Any]:
    """Calibration prompts from a JSONL file, one per line (blank lines skipped).

    A line is a JSON string, or an object with ``"text"``, ``"prompt"`` (a string) or
    ``"messages"`` (a chat: a list of ``{"role", "content"}``, rendered with the tokenizer's
    chat template), looked up in that order.

    Args:
        path: the file.
        limit: keep the first ``limit`` prompts (default all).

    Returns:
        Strings and message lists, in file order.

    Raises:
        ValueError: a line that is not valid JSON or holds none of the keys; no prompt at all;
            ``limit`` < 1.
        FileNotFoundError: no such file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit (calibration samples) must be >= 1, got {limit}")
    p = Path(path)
    prompts: list[Any] = []
    with p.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(p)}:{i}: not valid JSON ({e})") from e
            prompts.append(_prompt_of(item, f"{os.fspath(p)}:{i}"))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"empty calibration set: {os.fspath(p)} holds no prompt")
    return prompts


def _prompt_of(item: Any, where: str) -> Any:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("text", "prompt"):
            if isinstance(item.get(key), str):
                return item[key]
        msgs = item.get("messages")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs):
            return msgs
    raise ValueError(
        f"{where}: expected a JSON string or an object with 'text', 'prompt' (a string) or "
        "'messages' (a non-empty list of {'role', 'content'} objects)"
    )


def _token_ids(tokenizer: Any, prompt: Any, max_length: int) -> list[int]:
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return list(ids)[:max_length]


def calibrate_checkpoint(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Any],
    *,
    max_length: int = 2048,
    modules: Sequence[str] | None = None,
    skip: Sequence[str] = ("lm_head",),
    dtype: torch.dtype | None = None,
) -> Calibration:
    """Load an HF checkpoint and its tokenizer, and calibrate on ``prompts``.

    Each prompt runs alone (batch 1, no padding), so only real tokens reach the amax.

    Args:
        model_dir: an HF model directory with tokenizer files (the source of an export).
        prompts: strings and chat message lists (see `read_prompts`).
        max_length: tokens per prompt at most (longer prompts are cut).
        modules: as in `collect_input_amax`.
        skip: as in `collect_input_amax`.
        dtype: the model's compute dtype; default the checkpoint's own (config ``dtype``).

    Returns:
        A `Calibration`.

    Raises:
        ImportError: transformers is not installed.
        ValueError: no prompt, a prompt with no tokens, ``max_length`` < 1, and the errors of
            `collect_input_amax`.
    """
    if not prompts:
        raise ValueError("empty calibration set: pass at least one prompt")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    try:
        # The optional extra [calibrate]: not a dependency of the library code.
        from transformers import AutoModelForCausalLM, AutoTokenizer  # pants: no-infer-dep
    except ImportError as e:
        raise ImportError(
            "calibration loads the checkpoint with transformers: "
            "pip install 'miles-quant[calibrate]'"
        ) from e
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_dir))
    ids = []
    for k, prompt in enumerate(prompts):
        t = _token_ids(tokenizer, prompt, max_length)
        if not t:
            raise ValueError(f"calibration prompt {k} has no tokens; drop it from the data")
        ids.append(torch.tensor([t], dtype=torch.long))
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(os.fspath(model_dir), **kwargs)
    model.eval()
    return collect_input_amax(
        model, ({"input_ids": t, "use_cache": False} for t in ids), modules=modules, skip=skip
    )
