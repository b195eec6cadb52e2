"""Public entry points: quantize, dequantize and the QuantizedTensor they exchange."""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from miles_quant import _bits, _native, _reference
from miles_quant._layout import unpack_nibbles
from miles_quant._spec import E2M1, FORMATS, INPUT_DTYPES, Format, fp8_tile

Backend = Literal["auto", "native", "torch"]
_BACKENDS = ("auto", "native", "torch")
_warned_fallback = False


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A quantized tensor: element bits, scales and what is needed to read them back.

    Attributes:
        data: element bits. FP8 formats (fp8_*, mxfp8_*): float8_e4m3fn / float8_e5m2 of the
            input's shape. 4-bit formats (mxfp4, nvfp4, int4_*): uint8 [..., ceil(K/2)], two
            codes per byte, element 0 in the low nibble (E2M1 codes; INT4 as q + 8).
        scales: per-group scales (dequantization multipliers), shapes in docs/contract.md:
            fp8 float32, MX float8_e8m0fnu, NVFP4 float8_e4m3fn, INT4 in its scale dtype.
        format: the format name (see miles_quant.FORMATS).
        shape: shape of the original tensor.
        dtype: dtype of the original tensor.
        granularity: the scale-group shape used ("tensor", "channel", "1x128", "128x128",
            "1x32", "1x16", "16x16").
        scale_rule: the E8M0 rule for MX formats ("floor", "rceil", "even"), else None.
        global_scale: NVFP4 only: float32 per-tensor scale, shape () or [E] when stacked.
        stacked: the leading dim holds experts with their own tensor-level scales.
    """

    data: torch.Tensor
    scales: torch.Tensor
    format: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: str
    scale_rule: str | None = None
    global_scale: torch.Tensor | None = None
    stacked: bool = False


def _use_native(x: torch.Tensor, backend: str) -> bool:
    global _warned_fallback
    if backend == "torch":
        return False
    if x.device.type == "cuda":
        if _native.cuda_available():
            return True
        if backend == "native":
            raise RuntimeError(
                "backend='native' on a CUDA tensor needs the CUDA kernels "
                f"({_native.cuda_error()}); build with: "
                "pip install packages/miles-quant -Ccmake.define.MILES_QUANT_CUDA=ON"
            )
        return False
    if x.device.type != "cpu":
        if backend == "native":
            raise ValueError(
                f"backend='native' runs on CPU and CUDA tensors only (got a tensor on {x.device}); "
                "use backend='auto' or 'torch'"
            )
        return False
    if _native.available():
        return True
    if backend == "native":
        raise RuntimeError(
            f"backend='native' requested but the miles_quant extension is unavailable "
            f"({_native.error()}); reinstall with a C++ compiler: pip install packages/miles-quant"
        )
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"miles_quant: native extension unavailable ({_native.error()}); using the PyTorch "
            "reference (same bits, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _check_input(x: torch.Tensor, fmt: Format, granularity: str, stacked: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(
            f"quantize: unsupported dtype {x.dtype}; {fmt.name} takes float32, bfloat16 or "
            "float16 (cast to float32 first, x.float(): the contract starts from fp32 values)"
        )
    if x.dim() < 1:
        raise ValueError("quantize: expected a tensor with at least one dimension, got a scalar")
    if stacked and x.dim() < 2:
        raise ValueError("quantize: stacked=True needs a leading expert dim: [E, ..., K]")
    if granularity in ("128x128", "16x16"):
        want = 3 if stacked else 2
        if granularity == "128x128" and x.dim() < 2:
            raise ValueError(f"quantize: {fmt.name} needs [..., N, K], got {tuple(x.shape)}")
        if granularity == "16x16" and x.dim() != want:
            raise ValueError(
                f"quantize: nvfp4 16x16 takes a [N, K] weight (or [E, N, K] with "
                f"stacked=True), got {tuple(x.shape)}"
            )


def _matrices(shape: tuple[int, ...], fmt: Format, gran: str, stacked: bool) -> tuple[int, int]:
    """A tensor of `shape` as (b, r): b matrices of r rows (the kernels' batch). 128x128 tiles
    are per matrix, and with stacked=True so are the tensor-level scales (fp8 "tensor", the
    NVFP4 global scale); otherwise the rows of one matrix."""
    if gran == "128x128":
        return math.prod(shape[:-2]), shape[-2]
    if stacked and (gran == "tensor" or fmt.family == "nvfp4"):
        return shape[0], math.prod(shape[1:-1])
    return 1, math.prod(shape[:-1])


def _check_global_scale(
    g: torch.Tensor | float, fmt: Format, x: torch.Tensor, stacked: bool
) -> torch.Tensor:
    """A given NVFP4 global scale as a float32 tensor on x's device: [] or [E] (stacked)."""
    if fmt.family != "nvfp4":
        raise ValueError(
            f"quantize: global_scale applies to nvfp4 only, not {fmt.name} (other formats "
            "have no per-tensor scale; per-tensor FP8 with a past scale is DelayedScaler)"
        )
    if isinstance(g, bool) or not isinstance(g, (torch.Tensor, float, int)):
        raise ValueError(
            f"quantize: global_scale must be a float or a float32 tensor, got {type(g).__name__}"
        )
    if isinstance(g, torch.Tensor):
        if g.dtype != torch.float32:
            raise ValueError(
                f"quantize: global_scale must be float32 (the stored NVFP4 global scale), got "
                f"{g.dtype}; convert it explicitly if its rounding to fp32 is what you want"
            )
        experts = x.shape[0] if stacked else None
        if g.dim() != 0 and not (experts is not None and tuple(g.shape) == (experts,)):
            want = f"() or ({experts},) (one per expert)" if experts is not None else "()"
            raise ValueError(f"quantize: global_scale must have shape {want}, got {tuple(g.shape)}")
        t = g.detach()
        if t.device != x.device:
            t = t.to(x.device)
    else:
        t = torch.tensor(float(g), dtype=torch.float32, device=x.device)
    # Normal, positive, finite. On CPU in Python (the few torch ops of a vectorized check cost
    # more than a one-token quantize); elsewhere by torch ops (one device sync).
    bad: float | None = None
    if t.device.type == "cpu":
        bad = next((v for v in t.reshape(-1).tolist() if not _F32_MIN_NORMAL <= v < math.inf), None)
    else:
        bits = t.view(torch.int32)
        ok = (bits >= 0x00800000) & (bits < 0x7F800000)
        if not bool(ok.all()):
            bad = t[~ok].reshape(-1)[0].item()
    if bad is not None:
        raise ValueError(
            f"quantize: global_scale must be finite and at least 2^-126 (a normal positive "
            f"fp32), got {bad!r}"
        )
    return t


_F32_MIN_NORMAL = 2.0**-126


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layout(
    fmt: Format, gran: str, shape: tuple[int, ...], stacked: bool, scale_dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    """(shape, dtype) of data, scales and global_scale (None: absent) that quantize returns."""
    lead, k = shape[:-1], shape[-1]
    packed = (*lead, _cdiv(k, 2))
    if fmt.family == "fp8":
        assert fmt.element is not None
        assert fmt.element.torch_dtype is not None
        if gran == "tensor":
            s: tuple[int, ...] = (shape[0],) if stacked else ()
        elif gran == "channel":
            s = (*lead, 1 if k else 0)  # K = 0: no groups
        elif gran == "1x128":
            s = (*lead, _cdiv(k, 128))
        else:
            s = (*shape[:-2], _cdiv(shape[-2], 128), _cdiv(k, 128))
        return [(shape, fmt.element.torch_dtype), (s, torch.float32), None]
    if fmt.family == "mx":
        assert fmt.element is not None
        el_dt = fmt.element.torch_dtype
        data = (shape, el_dt) if el_dt is not None else (packed, torch.uint8)
        return [data, ((*lead, _cdiv(k, 32)), torch.float8_e8m0fnu), None]
    if fmt.family == "nvfp4":
        g = ((shape[0],) if stacked else (), torch.float32)
        return [(packed, torch.uint8), ((*lead, _cdiv(k, 16)), torch.float8_e4m3fn), g]
    return [(packed, torch.uint8), ((*lead, _cdiv(k, fmt.group)), scale_dtype), None]


def _check_out(
    out: QuantizedTensor,
    x: torch.Tensor,
    want: tuple[str, tuple[int, ...], torch.dtype, str, str | None, bool],
    layout: list[tuple[tuple[int, ...], torch.dtype] | None],
) -> tuple[torch.Tensor, ...]:
    """Checks that `out` can take this call's result; returns its buffers."""
    if not isinstance(out, QuantizedTensor):
        raise ValueError(f"quantize: out must be a QuantizedTensor, got {type(out).__name__}")
    have = (out.format, out.shape, out.dtype, out.granularity, out.scale_rule, out.stacked)
    if have != want:
        raise ValueError(
            "quantize: out= holds a different quantization (format, shape, dtype, granularity, "
            f"scale_rule, stacked) = {have}, this call makes {want}; pass the result of a "
            "quantize call with the same arguments and input shape and dtype"
        )
    bufs = (out.data, out.scales, out.global_scale)
    checked: list[torch.Tensor] = []
    for name, buf, lay in zip(("data", "scales", "global_scale"), bufs, layout, strict=True):
        if lay is None:
            continue
        if buf is None or buf.shape != lay[0] or buf.dtype != lay[1]:
            got = None if buf is None else (tuple(buf.shape), buf.dtype)
            raise ValueError(f"quantize: out.{name} must be {lay}, got {got}")
        if buf.device != x.device or not buf.is_contiguous():
            raise ValueError(
                f"quantize: out.{name} must be contiguous and on {x.device} (got "
                f"{buf.device}, contiguous={buf.is_contiguous()})"
            )
        checked.append(buf)
    return tuple(checked)


def quantize(
    x: torch.Tensor,
    format: str,
    *,
    granularity: str | None = None,
    scale_rule: str | None = None,
    stacked: bool = False,
    scale_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
    threads: int | None = None,
    out: QuantizedTensor | None = None,
    global_scale: torch.Tensor | float | None = None,
) -> QuantizedTensor:
    """Quantizes `x` under the precision contract (docs/contract.md).

    Groups run along the last dim K; a K (or N for 2-D tiles) that the block does not divide
    is quantized as if zero-padded (the last group is partial; no padding is stored except a
    final pad nibble in packed rows of odd K). Non-finite values poison their scale group: its
    scale is NaN and it dequantizes to NaN. The input is not modified and may be
    non-contiguous (it is copied then).

    Args:
        x: float32, bfloat16 or float16 tensor, at least 1-D (2-D for 128x128 and 16x16).
        format: one of miles_quant.FORMATS.
        granularity: scale groups. fp8_e4m3 / fp8_e5m2: "tensor" (default), "channel" (one
            scale per row: everything but the last dim), "1x128" (per-token groups of 128).
            fp8_block128: "128x128" over the last two dims. MX: "1x32". nvfp4: "1x16"
            (default) or "16x16" (one scale per 16x16 tile, repeated on its rows). int4_g32:
            "1x32"; int4_g128: "1x128".
        scale_rule: MX formats only: "floor" (OCP MX v1.0, default), "rceil" (NVIDIA) or
            "even" (torchao).
        stacked: x is [E, ...] stacked experts; tensor-level scales (fp8 "tensor", the NVFP4
            global scale) are computed per expert.
        scale_dtype: INT4 only: storage dtype of the scales, float32, bfloat16 or float16
            (default: x.dtype). Codes are computed against the stored scale; float16 scales
            saturate at 65504.
        backend: "native" (C++ on CPU tensors; the CUDA kernels on CUDA tensors, in builds
            with MILES_QUANT_CUDA=ON), "torch" (the reference; any device) or "auto" (native
            where it can run, else torch, with a one-time warning when the CPU extension is
            missing). All give the same bits.
        threads: CPU threads for the native backend, at least 1 (default
            torch.get_num_threads()). CUDA work is enqueued on the current stream.
        out: a QuantizedTensor from an earlier call with the same arguments and an input of
            the same shape and dtype: its buffers (data, scales, global_scale) are overwritten
            in place instead of allocating new ones (the native kernels write into them
            directly). Use it in loops: a fresh large buffer costs its first-touch page faults.
        global_scale: nvfp4 only: the fp32 global scale to use instead of the one computed from
            x's amax (a static or calibrated scale: ModelOpt's `input_scale` or
            `weight_scale_2`, `calibrate.input_scale(amax, "nvfp4")`, or an earlier result's
            `.global_scale`). A float or a float32 tensor of shape () (with stacked=True also
            [E], one per expert), each finite and at least 2^-126 (a normal positive fp32).
            There is no amax pass then (one read of x instead of two); values beyond 448 * 6 *
            global_scale saturate, and a block holding a NaN or Inf is poisoned alone (scale
            NaN, elements +0), not the whole tensor. The result's `.global_scale` is this
            value. `quantize(x, "nvfp4", global_scale=quantize(x, "nvfp4").global_scale)`
            gives the same bits as `quantize(x, "nvfp4")` for a finite x.

    Returns:
        A QuantizedTensor (with out=: one that shares out's buffers).

    Raises:
        ValueError: unknown format, granularity or scale rule; unsupported dtype or shape;
            threads < 1; an `out` that does not match this call (nothing is written then).
        RuntimeError: backend="native" without the extension.
    """
    if format not in FORMATS:
        raise ValueError(f"quantize: unknown format {format!r}; choose one of {sorted(FORMATS)}")
    fmt = FORMATS[format]
    gran = fmt.granularities[0] if granularity is None else granularity
    if gran not in fmt.granularities:
        raise ValueError(
            f"quantize: {format} has granularities {fmt.granularities}, got {granularity!r}"
        )
    rule: str | None = None
    if fmt.family == "mx":
        rule = fmt.scale_rules[0] if scale_rule is None else scale_rule
        if rule not in fmt.scale_rules:
            raise ValueError(f"quantize: scale_rule must be one of {fmt.scale_rules}, got {rule!r}")
    elif scale_rule is not None:
        raise ValueError(f"quantize: scale_rule applies to MX formats only, not {format}")
    if fmt.family != "int4" and scale_dtype is not None:
        raise ValueError(f"quantize: scale_dtype applies to int4 formats only, not {format}")
    if backend not in _BACKENDS:
        raise ValueError(f"quantize: backend must be one of {_BACKENDS}, got {backend!r}")
    _check_threads(threads, "quantize")
    _check_input(x, fmt, gran, stacked)
    given_sg = None if global_scale is None else _check_global_scale(global_scale, fmt, x, stacked)
    sd = x.dtype if scale_dtype is None else scale_dtype
    if fmt.family == "int4" and sd not in INPUT_DTYPES:
        raise ValueError(f"quantize: scale_dtype must be float32, bfloat16 or float16, got {sd}")
    shape = tuple(x.shape)
    layout = _layout(fmt, gran, shape, stacked, sd)
    into: tuple[torch.Tensor, ...] | None = None
    if out is not None:
        into = _check_out(out, x, (format, shape, x.dtype, gran, rule, stacked), layout)

    x = x.detach().contiguous()
    k = shape[-1]
    lead = shape[:-1]
    b, r = _matrices(shape, fmt, gran, stacked)

    if _use_native(x, backend):
        # The kernels write into the buffers of the result (out's, or new ones in its layout).
        if into is None:
            bufs = [torch.empty(s, dtype=d, device=x.device) for s, d in filter(None, layout)]
        else:
            bufs = list(into)
        data, scales = bufs[0], bufs[1]
        gscale = bufs[2] if len(bufs) > 2 else None
        if fmt.family == "fp8":
            assert fmt.element is not None
            tile = fp8_tile(gran, r, k)
            _native.fp8(x, (b, r, k), fmt.element, tile, gran == "tensor", data, scales, threads)
        elif fmt.family == "mx":
            assert fmt.element is not None
            assert rule is not None
            _native.mx(x, b * r, fmt.element, rule, data, scales, threads)
        elif fmt.family == "nvfp4":
            assert gscale is not None
            if given_sg is not None:  # a () scale goes to every expert; gscale may be given_sg
                gscale.copy_(given_sg)
            _native.nvfp4(
                x, (b, r, k), gran == "16x16", data, scales, gscale, given_sg is not None, threads
            )
        else:
            _native.int4(x, b * r, fmt.group, data, scales, threads)
        return QuantizedTensor(data, scales, format, shape, x.dtype, gran, rule, gscale, stacked)

    def make(
        data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> QuantizedTensor:
        if out is not None:  # the reference's results into out's buffers
            out.data.copy_(data)
            out.scales.copy_(scales)
            if out.global_scale is not None and global_scale is not None:
                out.global_scale.copy_(global_scale)
            data, scales, global_scale = out.data, out.scales, out.global_scale
        return QuantizedTensor(
            data, scales, format, shape, x.dtype, gran, rule, global_scale, stacked
        )

    if fmt.family == "fp8":
        el = fmt.element
        assert el is not None
        assert el.torch_dtype is not None
        per_matrix = gran == "tensor"
        codes, s = _reference.fp8(x.reshape(b, r, k), el, fp8_tile(gran, r, k), per_matrix)
        if per_matrix:
            scales = s.reshape(b) if stacked else s.reshape(())
        elif gran == "128x128":
            scales = s.reshape(*shape[:-2], *s.shape[1:])
        else:
            scales = s.reshape(*lead, s.shape[-1])
        return make(codes.view(el.torch_dtype).reshape(shape), scales)

    if fmt.family == "mx":
        el = fmt.element
        assert el is not None
        assert rule is not None
        d, s = _reference.mx(x.reshape(b * r, k), el, rule)
        data = d.reshape(*lead, d.shape[-1])
        if el.torch_dtype is not None:
            data = data.view(el.torch_dtype)
        return make(data, s.reshape(*lead, s.shape[-1]).view(torch.float8_e8m0fnu))

    if fmt.family == "nvfp4":
        # A copy: the caller may pass out.global_scale itself (out=q, global_scale=q.global_scale).
        gs = None if given_sg is None else given_sg.expand(b).clone()
        d, s, g = _reference.nvfp4(x.reshape(b, r, k), gran == "16x16", gs)
        data = d.reshape(*lead, d.shape[-1])
        scales = s.reshape(*lead, s.shape[-1]).view(torch.float8_e4m3fn)
        return make(data, scales, g.reshape(b) if stacked else g.reshape(()))

    assert fmt.family == "int4"
    d, s = _reference.int4(x.reshape(b * r, k), fmt.group, sd)
    return make(d.reshape(*lead, d.shape[-1]), s.reshape(*lead, s.shape[-1]))


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _expand_last(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=-1)[..., :k]


def _check_threads(threads: object, who: str) -> None:
    if threads is not None and (
        isinstance(threads, bool)
        or not hasattr(threads, "__index__")
        or operator.index(threads) < 1
    ):
        raise ValueError(
            f"{who}: threads must be a positive int (or None for torch.get_num_threads()), "
            f"got {threads!r}"
        )


# Native dequantization: element code and scale kind of the binding (_native.dequantize).
_INT4_CODE = 3
_SCALE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_E8M0_KIND, _E4M3_KIND = 3, 4
_CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _check_dequant_layout(q: QuantizedTensor, fmt: Format) -> None:
    """q's buffers must be what quantize returns for its format, granularity and shape."""
    if q.granularity not in fmt.granularities:
        raise ValueError(
            f"dequantize: {fmt.name} has granularities {fmt.granularities}, got {q.granularity!r}"
        )
    scale_dtype = q.scales.dtype if fmt.family == "int4" else torch.float32
    if fmt.family == "int4" and scale_dtype not in INPUT_DTYPES:
        raise ValueError(
            f"dequantize: int4 scales must be float32, bfloat16 or float16, got {scale_dtype}"
        )
    layout = _layout(fmt, q.granularity, tuple(q.shape), q.stacked, scale_dtype)
    device = q.data.device
    for name, buf, lay in zip(
        ("data", "scales", "global_scale"), (q.data, q.scales, q.global_scale), layout, strict=True
    ):
        if lay is None:
            continue
        if buf is None or tuple(buf.shape) != lay[0] or buf.dtype != lay[1]:
            got = None if buf is None else (tuple(buf.shape), buf.dtype)
            raise ValueError(
                f"dequantize: a {fmt.name} {q.granularity} QuantizedTensor of shape "
                f"{tuple(q.shape)} (stacked={q.stacked}) needs {name} {lay}, got {got}"
            )
        if buf.device != device:
            raise ValueError(
                f"dequantize: q.{name} is on {buf.device}, q.data on {device}: move them together"
            )


def _canonical_nans(t: torch.Tensor) -> torch.Tensor:
    """t with every NaN written as its dtype's canonical quiet NaN (in place; no host sync, so
    a CUDA dequantize stays asynchronous)."""
    t.view(_INT_VIEW[t.dtype]).masked_fill_(torch.isnan(t), _CANONICAL_NAN[t.dtype])
    return t


def dequantize(
    q: QuantizedTensor,
    dtype: torch.dtype = torch.float32,
    *,
    backend: Backend = "auto",
    threads: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reads a QuantizedTensor back: element value times its scale, in fp32, then one rounding
    to `dtype` (float32, bfloat16 or float16). Every NaN comes out as the dtype's canonical quiet
    NaN (fp32 ``0x7FC00000``, bf16 ``0x7FC0``, fp16 ``0x7E00``) on every backend and device.

    NVFP4 multiplies each element by (global scale * block scale), the product first
    (torchao's order). A NaN scale (a poisoned group) gives NaN for the whole group.

    Args:
        q: what quantize returned (or a QuantizedTensor in the same layout, e.g. read from a
            checkpoint).
        dtype: the output dtype.
        backend: "auto" (the native kernels on CPU when built, else torch ops), "native" (CPU
            kernels, raises if unavailable or on another device) or "torch" (the reference).
            Same bits on every backend.
        threads: CPU threads for the native backend, at least 1 (default
            torch.get_num_threads()).
        out: an optional contiguous tensor of q.shape and `dtype` on q's device to write into
            (reused buffers skip the allocation and its first-touch page faults).

    Returns:
        A tensor of q.shape and `dtype` on q.data's device (`out` when given).

    Raises:
        ValueError: `q` is not a QuantizedTensor of a known format, its buffers are not in the
            layout quantize returns for its format, granularity and shape (an NVFP4 one without
            its global_scale included), `dtype` is not float32 / bfloat16 / float16, a bad
            backend or threads, or an `out` of another shape, dtype or device.
    """
    if not isinstance(q, QuantizedTensor):
        raise ValueError(
            f"dequantize: expected a QuantizedTensor (from miles_quant.quantize), got "
            f"{type(q).__name__}"
        )
    if q.format not in FORMATS:
        raise ValueError(
            f"dequantize: unknown format {q.format!r}; choose one of {sorted(FORMATS)}"
        )
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    if backend not in _BACKENDS:
        raise ValueError(f"dequantize: backend must be one of {_BACKENDS}, got {backend!r}")
    _check_threads(threads, "dequantize")
    fmt = FORMATS[q.format]
    if fmt.family == "nvfp4" and q.global_scale is None:
        raise ValueError("dequantize: an nvfp4 QuantizedTensor needs its global_scale (fp32)")
    _check_dequant_layout(q, fmt)
    shape = tuple(q.shape)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"dequantize: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(
                f"dequantize: out must have shape {shape} and dtype {dtype}, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        if out.device != q.data.device or not out.is_contiguous():
            raise ValueError(
                f"dequantize: out must be contiguous and on {q.data.device} (got {out.device}, "
                f"contiguous={out.is_contiguous()})"
            )
    if _use_native_dequant(q.data, backend):
        result = out if out is not None else torch.empty(shape, dtype=dtype)
        if result.numel() == 0:  # no elements (the layouts may still hold a tensor-level scale)
            return result
        k = shape[-1]
        b, r = _matrices(shape, fmt, q.granularity, q.stacked)
        if fmt.family == "fp8":
            tile = fp8_tile(q.granularity, r, k)
            kind = _SCALE_KINDS[torch.float32]
        elif fmt.family == "mx":
            tile, kind = (1, 32), _E8M0_KIND
        elif fmt.family == "nvfp4":
            tile, kind = (1, 16), _E4M3_KIND
        else:
            tile, kind = (1, fmt.group), _SCALE_KINDS[q.scales.dtype]
        code = _INT4_CODE if fmt.element is None else fmt.element.code
        g = None if q.global_scale is None else q.global_scale.contiguous()
        _native.dequantize(
            q.data.contiguous(), code, (b, r, k), tile, q.scales.contiguous(), kind, g, result,
            threads,
        )  # fmt: skip
        return result
    ref = _canonical_nans(_dequantize_reference(q, fmt).to(dtype))
    if out is None:
        return ref
    return out.copy_(ref)


def _use_native_dequant(data: torch.Tensor, backend: str) -> bool:
    """Native dequantization runs on CPU tensors; elsewhere the torch ops (same bits)."""
    if backend == "torch":
        return False
    if data.device.type != "cpu":
        if backend == "native":
            raise ValueError(
                f"dequantize: backend='native' runs on CPU tensors only (got {data.device}); "
                "use backend='auto' or 'torch' (torch ops on the device, same bits)"
            )
        return False
    return _use_native(data, backend)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes: _bits.decode of the 16 codes, looked up (same values, about
    10x faster than decoding every element)."""
    table = _bits.decode(torch.arange(16, dtype=torch.uint8, device=codes.device), E2M1)
    return table[codes.long()]


def _dequantize_reference(q: QuantizedTensor, fmt: Format) -> torch.Tensor:
    """value(code) * scale in fp32 by torch ops, shape q.shape."""
    shape = q.shape
    k = shape[-1]
    if fmt.family == "fp8":
        v = q.data.to(torch.float32)
        s = q.scales
        if q.granularity == "tensor":
            s = s.reshape(*s.shape, *([1] * (len(shape) - s.dim())))
        elif q.granularity == "1x128":
            s = _expand_last(s, 128, k)
        elif q.granularity == "128x128":
            s = _expand_last(s, 128, k).repeat_interleave(128, dim=-2)[..., : shape[-2], :]
        out = v * s
    elif fmt.family == "mx":
        el = fmt.element
        assert el is not None
        if el.torch_dtype is None:
            v = _e2m1_values(unpack_nibbles(q.data, k))
        else:
            v = q.data.to(torch.float32)
        s = _bits.e8m0_value(q.scales.view(torch.uint8))
        out = v * _expand_last(s, 32, k)
    elif fmt.family == "nvfp4":
        assert q.global_scale is not None  # checked above
        v = _e2m1_values(unpack_nibbles(q.data, k))
        g = q.global_scale.reshape(
            *q.global_scale.shape, *([1] * (len(shape) - q.global_scale.dim()))
        )
        s = g * q.scales.to(torch.float32)
        out = v * _expand_last(s, 16, k)
    else:
        codes = unpack_nibbles(q.data, k).to(torch.int32) - 8
        s = q.scales.to(torch.float32)
        out = codes.to(torch.float32) * _expand_last(s, fmt.group, k)
    return out.reshape(shape)
