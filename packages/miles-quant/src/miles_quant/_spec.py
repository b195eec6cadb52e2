"""Format names, element formats and the constants of the precision contract (docs/contract.md).

The C++ side mirrors these in native/quant/include/miles_quant/{elements,contract}.h.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Element:
    """A small binary float format (OCP FP8 / FP4), by its bit fields."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest finite value
    max_code: int  # magnitude code of the largest finite value
    nan_code: int  # magnitude code written for NaN (E2M1 has none: +0)
    max_value: float
    code: int  # element code shared with the native binding
    torch_dtype: torch.dtype | None  # storage dtype of unpacked codes (None: packed nibbles)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


E4M3 = Element("e4m3", 4, 3, 7, 8, 0x7E, 0x7F, 448.0, 0, torch.float8_e4m3fn)
E5M2 = Element("e5m2", 5, 2, 15, 15, 0x7B, 0x7F, 57344.0, 1, torch.float8_e5m2)
E2M1 = Element("e2m1", 2, 1, 1, 2, 0x7, 0x0, 6.0, 2, None)
ELEMENTS = {e.name: e for e in (E4M3, E5M2, E2M1)}

# FP8 (all granularities) and the NVFP4 global scale: amax is raised to at least this.
AMAX_MIN = 1e-10
# NVFP4: global scale = amax / (448 * 6); block scales clamped to [2^-6, 448] before E4M3.
NVFP4_GLOBAL_DIVISOR = 2688.0
NVFP4_BLOCK_SCALE_MIN = 2.0**-6
# INT4 symmetric: scale = max(amax / 7, 1e-5); codes clamp(rne(x / scale), -7, 7) stored as q + 8.
INT4_QMAX = 7.0
INT4_SCALE_MIN = 1e-5

SCALE_RULES = ("floor", "rceil", "even")
SCALE_RULE_CODES = {"floor": 0, "rceil": 1, "even": 2}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True, slots=True)
class Format:
    """A quantization format: element, block shape choices and how scales are stored."""

    name: str
    family: str  # "fp8", "mx", "nvfp4", "int4"
    element: Element | None  # None for int4
    granularities: tuple[str, ...]  # the first is the default
    scale_rules: tuple[str, ...] = ()  # MX only; the first is the default
    group: int = 0  # block length along the last dim (mx 32, nvfp4 16, int4 32/128)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp8_e4m3", "fp8", E4M3, ("tensor", "channel", "1x128")),
        Format("fp8_e5m2", "fp8", E5M2, ("tensor", "channel", "1x128")),
        Format("fp8_block128", "fp8", E4M3, ("128x128",)),
        Format("mxfp8_e4m3", "mx", E4M3, ("1x32",), SCALE_RULES, 32),
        Format("mxfp8_e5m2", "mx", E5M2, ("1x32",), SCALE_RULES, 32),
        Format("mxfp4", "mx", E2M1, ("1x32",), SCALE_RULES, 32),
        Format("nvfp4", "nvfp4", E2M1, ("1x16", "16x16"), (), 16),
        Format("int4_g32", "int4", None, ("1x32",), (), 32),
        Format("int4_g128", "int4", None, ("1x128",), (), 128),
    )
}


def fp8_tile(granularity: str, rows: int, cols: int) -> tuple[int, int]:
    """Tile (rows, cols) of one FP8 scale group in a [rows, cols] matrix."""
    if granularity == "tensor":
        return max(rows, 1), max(cols, 1)
    if granularity == "channel":
        return 1, max(cols, 1)
    if granularity == "1x128":
        return 1, 128
    assert granularity == "128x128", granularity
    return 128, 128
