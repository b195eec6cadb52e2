"""Which tensors of a checkpoint are quantized and which stay in their source precision.

The rules (in this order; the first that applies decides):

1. Only floating-point matrices are candidates: float32 / bfloat16 / float16 tensors that are
   2-D and named ``*.weight`` (Linear weights) or 3-D (fused MoE expert parameters such as
   ``mlp.experts.gate_up_proj``). Everything else (norms, biases, buffers) is kept.
2. `ALWAYS_KEEP` (embeddings, lm_head, norms, routers/gates, biases) is kept.
3. A user ``keep`` pattern that matches is kept.
4. A tensor of one of the first / last N transformer layers is kept.
5. With ``only`` patterns, a tensor that matches none of them is kept.

Patterns: a glob (``fnmatch``, case-sensitive) matches a tensor when it matches the tensor's
name or the name of a module that contains it (``lm_head`` and ``model.layers.0`` both work,
as do ``*.experts.*`` and ``*.q_proj.weight``); a pattern starting with ``re:`` is a regular
expression searched in the tensor name.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALWAYS_KEEP", "DEFAULT_QAT_PATTERNS", "Selector", "layer_index", "matches"]

ALWAYS_KEEP: tuple[str, ...] = (
    r"re:(^|\.)(embed_tokens|embeddings|embed_in|wte|wpe|word_embeddings)\.",
    r"re:(^|\.)(lm_head|embed_out|output_layer)\.",
    r"re:norm",  # input_layernorm, q_norm, final norm, ...
    r"re:(^|\.)ln_",
    r"re:(^|\.)(gate|router|shared_expert_gate)\.",  # MoE routers (not gate_proj)
    r"re:bias$",
)
DEFAULT_QAT_PATTERNS: tuple[str, ...] = ("*.experts.*",)

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


def _check_pattern(p: str) -> None:
    if not isinstance(p, str) or not p:
        raise ValueError(f"patterns must be non-empty strings, got {p!r}")
    if p.startswith("re:"):
        try:
            re.compile(p[3:])
        except re.error as e:
            raise ValueError(f"bad regular expression in pattern {p!r}: {e}") from e


def check_pattern_list(value: object, what: str) -> None:
    """Refuses a bare string where a list of patterns is expected: iterating it would make
    every character a pattern (and ``"*"`` selects everything)."""
    if isinstance(value, str):
        raise ValueError(
            f"{what} takes a list of patterns, got the string {value!r}; pass [{value!r}]"
        )


def matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` (a glob, or ``re:`` + a regex) selects the tensor ``name``."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(len(parts), 0, -1))


def layer_index(name: str) -> int | None:
    """The transformer layer a tensor belongs to (``model.layers.7.mlp...`` -> 7), or None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Selector:
    """Decides, per tensor, whether it is quantized (see the module docstring).

    Attributes:
        keep: patterns of tensors kept in source precision.
        keep_first_layers: keep every tensor of transformer layers 0 .. N-1.
        keep_last_layers: keep every tensor of the last N transformer layers.
        only: if set, quantize only tensors matching one of these patterns.
        num_layers: number of transformer layers (for keep_last_layers).
    """

    keep: tuple[str, ...] = ()
    keep_first_layers: int = 0
    keep_last_layers: int = 0
    only: tuple[str, ...] | None = None
    num_layers: int = 0

    def __post_init__(self) -> None:
        for p in (*self.keep, *(self.only or ())):
            _check_pattern(p)
        if self.keep_first_layers < 0 or self.keep_last_layers < 0:
            raise ValueError(
                "keep_first_layers and keep_last_layers must be >= 0, got "
                f"{self.keep_first_layers} and {self.keep_last_layers}"
            )
        if self.only is not None and not self.only:
            raise ValueError("only= must name at least one pattern (or be None for all)")

    def reason_kept(self, name: str, dtype: torch.dtype | None, shape: Sequence[int]) -> str | None:
        """Why ``name`` stays unquantized ("not a matrix", "always kept", ...), or None."""
        dim = len(shape)
        if dtype not in _FLOAT or not ((dim == 2 and name.endswith(".weight")) or dim == 3):
            return "not a weight matrix"
        if any(matches(name, p) for p in ALWAYS_KEEP):
            return "always kept"
        if any(matches(name, p) for p in self.keep):
            return "keep pattern"
        idx = layer_index(name)
        if idx is not None:
            if idx < self.keep_first_layers:
                return "first layers"
            if self.keep_last_layers and idx >= self.num_layers - self.keep_last_layers:
                return "last layers"
        if self.only is not None and not any(matches(name, p) for p in self.only):
            return "not in only="
        return None
