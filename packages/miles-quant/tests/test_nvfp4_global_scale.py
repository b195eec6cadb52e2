"""NVFP4 with a given global scale (`quantize(x, "nvfp4", global_scale=...)`): a static or
calibrated per-tensor scale (ModelOpt's input_scale / weight_scale_2) instead of the one from x's
amax. One read of x, values beyond 448 * 6 * s_g saturate, and a block holding NaN or Inf is
poisoned alone. Native (every CPU ISA) == reference bit for bit; the computed scale given back
reproduces the dynamic result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _quant_testlib import assert_same_quantized, bits, require_native

import miles_quant as mq
from miles_quant import _native
from miles_quant.calibrate import input_scale

DTYPES = (torch.bfloat16, torch.float32, torch.float16)
# (shape, stacked): whole 256-wide batches with a tail, rows shorter than a batch, experts.
SHAPES = (((40, 4096 + 48), False), ((33, 300), False), ((3, 32, 1024 + 16), True))


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    x.view(-1)[::97] = 0.0
    return x.to(dtype)


def _scales(q: mq.QuantizedTensor) -> torch.Tensor:
    return q.scales.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gran", ["1x16", "16x16"])
def test_the_computed_global_scale_given_back_gives_the_dynamic_bits(
    dtype: torch.dtype, gran: str
) -> None:
    require_native()
    for i, (shape, stacked) in enumerate(SHAPES):
        if gran == "16x16" and shape[-2] % 16:
            continue
        x = _x(shape, dtype, i)
        for backend in ("native", "torch"):
            dyn = mq.quantize(x, "nvfp4", granularity=gran, stacked=stacked, backend=backend)
            got = mq.quantize(
                x, "nvfp4", granularity=gran, stacked=stacked, backend=backend,
                global_scale=dyn.global_scale,
            )  # fmt: skip
            assert_same_quantized(got, dyn)


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    flat = y.view(-1)
    flat[5] = float("nan")
    flat[-1] = float("inf")
    flat[flat.numel() // 2] = float("-inf")
    return y


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_equals_reference_with_any_given_scale(dtype: torch.dtype) -> None:
    require_native()
    for i, (shape, stacked) in enumerate(SHAPES):
        x = _poisoned(_x(shape, dtype, 10 + i))
        finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
        amax = input_scale(finite.abs().max(), "nvfp4")  # the tables' domain (a bf16 amax)
        experts = shape[0] if stacked else 1
        given = [amax, amax * 0.3, amax * 7.0, torch.tensor(1.0), torch.tensor(2.0**-126)]
        if stacked:
            given.append(torch.tensor([amax * 0.5, amax, amax * 3.0][:experts]))
        for g in given:
            for gran in ("1x16", "16x16"):
                if gran == "16x16" and shape[-2] % 16:
                    continue
                kw = {"granularity": gran, "stacked": stacked, "global_scale": g}
                nat = mq.quantize(x, "nvfp4", backend="native", **kw)
                ref = mq.quantize(x, "nvfp4", backend="torch", **kw)
                assert_same_quantized(nat, ref)
                assert torch.equal(bits(nat.global_scale), bits(g.expand(nat.global_scale.shape)))


def test_a_block_with_nan_or_inf_is_poisoned_alone() -> None:
    x = _x((8, 512), torch.bfloat16, 3)
    y = x.clone()
    y[2, 40] = float("nan")  # block (2, 2)
    y[5, 500] = float("-inf")  # block (5, 31)
    s = mq.quantize(x, "nvfp4").global_scale
    clean = mq.quantize(x, "nvfp4", global_scale=s)
    for backend in ("native", "torch"):
        if backend == "native":
            require_native()
        q = mq.quantize(y, "nvfp4", global_scale=s, backend=backend)
        sc, data = _scales(q), q.data
        bad = torch.zeros_like(sc, dtype=torch.bool)
        bad[2, 2] = bad[5, 31] = True
        assert torch.all(sc[bad] == 0x7F)
        assert torch.equal(sc[~bad], _scales(clean)[~bad])
        assert torch.all(data[2, 16:24] == 0)
        assert torch.all(data[5, 248:256] == 0)
        keep = torch.ones_like(data, dtype=torch.bool)
        keep[2, 16:24] = keep[5, 248:256] = False
        assert torch.equal(data[keep], clean.data[keep])
        d = mq.dequantize(q, torch.float32)
        assert torch.isnan(d[2, 32:48]).all()
        assert torch.isnan(d[5, 496:512]).all()
        assert torch.isfinite(d[0]).all()
        # The dynamic path poisons the whole tensor instead.
        assert torch.all(_scales(mq.quantize(y, "nvfp4", backend=backend)) == 0x7F)


def test_values_beyond_the_given_scale_saturate() -> None:
    x = _x((4, 256), torch.float32, 4)
    s = 1e-3  # the range is +-448 * 6 * 1e-3 = +-2.688; x reaches far beyond
    for backend in ("native", "torch"):
        if backend == "native":
            require_native()
        q = mq.quantize(x, "nvfp4", global_scale=s, backend=backend)
        d = mq.dequantize(q, torch.float32)
        top = float(torch.tensor(s, dtype=torch.float32)) * 448 * 6
        assert d.abs().max().item() == pytest.approx(top, rel=1e-6)
        big = x.abs() > top
        assert big.any()
        assert torch.allclose(d[big].abs(), torch.full_like(d[big], top), rtol=1e-6)
        assert torch.equal(torch.sign(d[big]), torch.sign(x[big]))


def test_out_and_python_floats() -> None:
    require_native()
    x = _x((16, 768), torch.bfloat16, 5)
    q = mq.quantize(x, "nvfp4", global_scale=0.01)
    assert q.global_scale.dtype == torch.float32
    assert q.global_scale.shape == ()
    assert q.global_scale.item() == float(torch.tensor(0.01, dtype=torch.float32))
    buf = mq.quantize(x * 2, "nvfp4")
    again = mq.quantize(x, "nvfp4", global_scale=0.01, out=buf)
    assert again.data.data_ptr() == buf.data.data_ptr()
    assert_same_quantized(again, q)
    # The scale of the buffer being overwritten, as a calibrated loop would pass it.
    same = mq.quantize(x, "nvfp4", global_scale=buf.global_scale, out=buf)
    assert_same_quantized(same, q)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "mxfp4", "global_scale": 1.0}, "applies to nvfp4 only"),
        ({"format": "fp8_e4m3", "global_scale": 1.0}, "DelayedScaler"),
        ({"global_scale": torch.tensor(1.0, dtype=torch.float64)}, "must be float32"),
        ({"global_scale": torch.tensor([1.0, 2.0])}, r"shape \(\)"),
        ({"global_scale": "1.0"}, "a float or a float32 tensor"),
        ({"global_scale": True}, "a float or a float32 tensor"),
        ({"global_scale": 0.0}, "at least 2"),
        ({"global_scale": -1.0}, "at least 2"),
        ({"global_scale": float("inf")}, "finite"),
        ({"global_scale": float("nan")}, "finite"),
        ({"global_scale": 1e-39}, "normal positive"),  # subnormal in fp32
    ],
)
def test_bad_global_scales_are_refused(kwargs: dict[str, object], message: str) -> None:
    x = torch.ones(4, 32)
    fmt = kwargs.pop("format", "nvfp4")
    with pytest.raises(ValueError, match=message):
        mq.quantize(x, fmt, **kwargs)  # type: ignore[arg-type]


def test_stacked_scales_need_one_per_expert() -> None:
    x = torch.ones(3, 4, 32)
    with pytest.raises(ValueError, match=r"\(3,\) \(one per expert\)"):
        mq.quantize(x, "nvfp4", stacked=True, global_scale=torch.ones(2))
    q = mq.quantize(x, "nvfp4", stacked=True, global_scale=torch.tensor(0.5))  # one for all
    assert torch.equal(q.global_scale, torch.full((3,), 0.5))


_CHILD = """
import sys, torch, miles_quant as mq
from miles_quant import _native
sys.path.insert(0, sys.argv[2])
from test_nvfp4_global_scale import SHAPES, _poisoned, _x
assert _native.isa() == sys.argv[1], (_native.isa(), sys.argv[1])
out = []
for i, (shape, stacked) in enumerate(SHAPES):
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = _poisoned(_x(shape, dtype, 20 + i))
        dyn = mq.quantize(_x(shape, dtype, 20 + i), "nvfp4").global_scale
        for g in (torch.tensor(0.0123), dyn):
            if stacked and g.dim():
                g = g[0]
            q = mq.quantize(x, "nvfp4", stacked=stacked, global_scale=g, backend="native")
            ref = mq.quantize(x, "nvfp4", stacked=stacked, global_scale=g, backend="torch")
            assert torch.equal(q.data, ref.data), (i, dtype, g)
            same = torch.equal(q.scales.view(torch.uint8), ref.scales.view(torch.uint8))
            assert same, (i, dtype, g)
            out.append((i, str(dtype)))
print("checked", len(out))
"""


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_every_isa_equals_the_reference_with_a_given_scale(isa: str) -> None:
    # This process runs the best ISA (the tests above); each lower one runs in a subprocess.
    require_native()
    if _native.isa() == "generic" and isa == "avx2":
        pytest.skip("this CPU has no AVX2")
    if isa == "avx512" and _native.isa() != "avx512vbmi":
        pytest.skip("the plain AVX-512 build is only a lower ISA on a CPU with AVX512-VBMI")
    env = {**os.environ, "MILES_QUANT_ISA": isa, "OMP_NUM_THREADS": "1"}
    here = str(Path(__file__).resolve().parent)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, isa, here],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checked 18" in r.stdout, r.stdout


@pytest.mark.parametrize("gran", ["1x16", "16x16"])
def test_alternating_scales_reuse_no_stale_tables(gran: str) -> None:
    # The AVX512-VBMI kernels keep the last global scale's tables per thread: calls that
    # alternate scales (given and computed, single rows and whole matrices, on one thread)
    # must each give the reference's bits.
    require_native()
    g = torch.Generator().manual_seed(5)
    xs = [(torch.randn(32, 512, generator=g) * s).to(torch.bfloat16) for s in (1.0, 3e-3, 70.0)]
    scales = [None, torch.tensor(0.0123), None, torch.tensor(1.0), torch.tensor(0.0123), None]
    for i, s in enumerate(scales * 2):
        x = xs[i % len(xs)]
        kw = {"granularity": gran, "global_scale": s, "threads": 1}
        got = mq.quantize(x, "nvfp4", backend="native", **kw)  # type: ignore[arg-type]
        kw.pop("threads")
        assert_same_quantized(got, mq.quantize(x, "nvfp4", backend="torch", **kw))  # type: ignore[arg-type]
