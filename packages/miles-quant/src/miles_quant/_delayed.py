"""Delayed (amax-history) scaling of activations: quantize with a scale taken from the recent
past instead of the current tensor (TransformerEngine's "delayed scaling" recipe).

Dynamic per-tensor scaling needs the current amax before the cast (one extra pass and, on a GPU,
a reduction the cast waits for). Delayed scaling takes the max of the last `history` recorded
amaxes, quantizes with it (values above it saturate), then records the current amax for the
next call. The FP8 arithmetic is the contract's per-tensor FP8 (docs/contract.md, section 4)
with the amax replaced by the history max; NVFP4's global scale comes from the history max the
same way and goes to `quantize(x, "nvfp4", global_scale=...)` (the block scales stay dynamic).
"""

from __future__ import annotations

from typing import Literal

import torch

from miles_quant import _bits, _native
from miles_quant._api import QuantizedTensor, quantize
from miles_quant._spec import AMAX_MIN, FORMATS, INPUT_DTYPES, NVFP4_GLOBAL_DIVISOR

_DELAYED_FORMATS = ("fp8_e4m3", "fp8_e5m2", "nvfp4")


class DelayedScaler:
    """Per-tensor FP8 (or the NVFP4 global scale) with the scale from an amax history.

    Each `quantize(x)` call:

    1. takes `amax_used` = the max of the recorded amaxes (at most `history` of them, newest
       last); when nothing is recorded yet, or every recorded amax is 0 (a zero history says
       nothing about the scale), the amax of x itself;
    2. computes the scale (a dequantization multiplier, fp32 operations in this order)
       `s = (max(amax_used, 1e-10) / max_elem) * 2^margin` and the element codes
       `encode(x / s)` (round to nearest even, saturating: values beyond `amax_used` clamp to
       +-max_elem);
    3. records amax(x) into the history (dropping the oldest beyond `history`). An empty x
       (say, an MoE expert no token reached) holds no values and records nothing.

    A tensor holding NaN or Inf is poisoned as in the contract (section 2): scale NaN, every code
    the NaN code (0x7F); its amax is not recorded, so one bad batch does not poison the next
    `history` steps.

    The result is an ordinary QuantizedTensor (granularity "tensor") that `dequantize` reads.
    The native and torch backends give the same bits. The history lives on the device of the
    inputs; on a CUDA tensor each call synchronises once (to check the amax is finite).

    "nvfp4" (1x16 blocks, activations): step 2 computes the global scale
    `s_g = (max(amax_used, 1e-10) / 2688) * 2^margin` and quantizes with
    `quantize(x, "nvfp4", global_scale=s_g)`: block scales from each block, values beyond
    `2688 * s_g` saturate, and a NaN or Inf poisons only its block (its amax is not recorded).
    A first call (nothing recorded) gives the bits of the dynamic `quantize(x, "nvfp4")`.

    Args:
        format: "fp8_e4m3" (default), "fp8_e5m2" or "nvfp4".
        history: how many past amaxes the scale looks at (>= 1; TransformerEngine's default
            amax_history_len is 1024, 16 is a common short window).
        margin: extra headroom as a power of two: the scale is multiplied by 2^margin (>= 0).
        backend: "auto", "native" or "torch", as for `quantize` (the cast runs natively on CPU
            tensors when the extension is built).
    """

    def __init__(
        self,
        format: str = "fp8_e4m3",
        *,
        history: int = 16,
        margin: int = 0,
        backend: Literal["auto", "native", "torch"] = "auto",
    ) -> None:
        if format not in _DELAYED_FORMATS:
            raise ValueError(
                f"DelayedScaler: format must be one of {_DELAYED_FORMATS} (a per-tensor scale), "
                f"got {format!r}; the other block formats (MX, fp8 1x128 / 128x128, INT4) have "
                "no per-tensor scale: each block is scaled dynamically"
            )
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"DelayedScaler: history must be an int >= 1, got {history!r}")
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"DelayedScaler: margin must be an int >= 0, got {margin!r}")
        if backend not in ("auto", "native", "torch"):
            raise ValueError(f"DelayedScaler: backend must be auto, native or torch: {backend!r}")
        self.format = format
        self.history = history
        self.margin = margin
        self.backend = backend
        self._amax = torch.zeros(history, dtype=torch.float32)  # ring buffer
        self._count = 0  # amaxes recorded so far (the ring holds min(count, history))

    @property
    def amax_history(self) -> torch.Tensor:
        """The recorded amaxes in the window, oldest first (fp32, length <= history)."""
        n = min(self._count, self.history)
        start = self._count % self.history if self._count > self.history else 0
        return torch.roll(self._amax, -start)[:n].clone()

    def next_amax(self) -> torch.Tensor | None:
        """The amax the next call will use; None when it uses its own (nothing recorded yet, or
        every recorded amax is 0)."""
        m = self._history_max()
        return None if m is None or not bool(m > 0) else m

    def _history_max(self) -> torch.Tensor | None:
        if self._count == 0:
            return None
        return self._amax[: min(self._count, self.history)].max()

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantizes x (float32, bfloat16 or float16, at least 1-D) with the delayed scale and
        records its amax. Returns a QuantizedTensor: data float8 of x's shape, scales a float32
        scalar tensor (FP8); or an "nvfp4" one with global_scale the delayed scale."""
        if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES or x.dim() < 1:
            what = type(x).__name__ if not isinstance(x, torch.Tensor) else f"{x.dtype} {x.dim()}-D"
            raise ValueError(
                f"DelayedScaler.quantize: expected a float32, bfloat16 or float16 tensor with at "
                f"least one dimension, got {what}"
            )
        if self.format == "nvfp4":
            return self._quantize_nvfp4(x)
        el = FORMATS[self.format].element
        assert el is not None
        assert el.torch_dtype is not None
        if self._amax.device != x.device:
            self._amax = self._amax.to(x.device)
        xf = x.detach().to(torch.float32).contiguous()
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        amax_now = xf.abs().amax() if xf.numel() else zero  # NaN and Inf propagate
        finite = bool(torch.isfinite(amax_now))
        hist = self._history_max()
        # No host synchronisation here: a zero history max falls back to x's own amax.
        used = amax_now if hist is None else torch.where(hist > 0, hist, amax_now)
        scale = _bits.div(torch.clamp_min(used, AMAX_MIN), el.max_value)
        if self.margin:
            scale = scale * (2.0**self.margin)
        if finite:
            y = xf / scale
            native = self.backend != "torch" and x.device.type == "cpu" and _native.available()
            if self.backend == "native" and not native:
                raise RuntimeError(
                    "DelayedScaler: backend='native' needs the extension and a CPU tensor "
                    f"({_native.error() or 'tensor on ' + str(x.device)})"
                )
            codes = _native.encode(y, el) if native else _bits.encode(y, el)
            if xf.numel():
                self._amax[self._count % self.history] = amax_now
                self._count += 1
        else:
            scale = torch.full((), float("nan"), dtype=torch.float32, device=x.device)
            codes = torch.full(x.shape, el.nan_code, dtype=torch.uint8, device=x.device)
        return QuantizedTensor(
            codes.view(el.torch_dtype).reshape(x.shape),
            scale.reshape(()),
            self.format,
            tuple(x.shape),
            x.dtype,
            "tensor",
        )

    def _quantize_nvfp4(self, x: torch.Tensor) -> QuantizedTensor:
        if self._amax.device != x.device:
            self._amax = self._amax.to(x.device)
        xf = x.detach().to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        amax_now = xf.abs().amax() if xf.numel() else zero  # NaN and Inf propagate
        finite = bool(torch.isfinite(amax_now))
        hist = self._history_max()
        used = amax_now if hist is None else torch.where(hist > 0, hist, amax_now)
        if not bool(torch.isfinite(used)):
            # Nothing recorded and x is not finite: no scale to take; the dynamic contract
            # poisons the whole tensor (global scale NaN), and nothing is recorded.
            return quantize(x, "nvfp4", backend=self.backend)
        s = _bits.div(torch.clamp_min(used, AMAX_MIN), NVFP4_GLOBAL_DIVISOR)
        if self.margin:
            s = s * (2.0**self.margin)
        q = quantize(x, "nvfp4", backend=self.backend, global_scale=s)
        if finite and xf.numel():
            self._amax[self._count % self.history] = amax_now
            self._count += 1
        return q

    def state_dict(self) -> dict[str, object]:
        """Checkpointable state: the settings and the amax history (plain tensors and ints)."""
        return {
            "format": self.format,
            "history": self.history,
            "margin": self.margin,
            "amax_history": self.amax_history.cpu(),
            "num_recorded": self._count,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores a state_dict() of a scaler with the same format, history and margin."""
        mine = (self.format, self.history, self.margin)
        theirs = (state.get("format"), state.get("history"), state.get("margin"))
        if theirs != mine:
            raise ValueError(
                f"DelayedScaler.load_state_dict: the state is for (format, history, margin) = "
                f"{theirs}, this scaler is {mine}; build the scaler with the same settings"
            )
        amax = state.get("amax_history")
        count = state.get("num_recorded")
        if not isinstance(amax, torch.Tensor) or not isinstance(count, int) or count < 0:
            raise ValueError(
                "DelayedScaler.load_state_dict: amax_history must be a tensor and num_recorded "
                "an int >= 0"
            )
        if amax.shape != (min(count, self.history),) or not torch.isfinite(amax).all():
            raise ValueError(
                f"DelayedScaler.load_state_dict: amax_history must hold min(num_recorded, "
                f"history) = {min(count, self.history)} finite values, got {tuple(amax.shape)}"
            )
        ring = torch.zeros(self.history, dtype=torch.float32, device=self._amax.device)
        # Put the window back so that the next record overwrites the oldest entry.
        n = amax.numel()
        start = count % self.history if count > self.history else 0
        idx = (torch.arange(n) + start) % self.history
        ring[idx.to(ring.device)] = amax.to(torch.float32).to(ring.device)
        self._amax = ring
        self._count = count
