"""Block formats against public implementations, bit for bit where the contract follows them,
and with the differing blocks asserted to be exactly the documented ones elsewhere:

- torchao 0.18 `to_mx` (MXFP8/MXFP4, FLOOR, EVEN, RCEIL) and `nvfp4_quantize` (two-level);
- the FP8 formula of SGLang/vLLM `per_token_group_quant_fp8` and DeepSeek-V3 block scaling,
  written out with torch's saturating E4M3 cast;
- torchao's `to_blocked` for the swizzled scale layout.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _quant_testlib import all_bf16, bits

import miles_quant as mq
from miles_quant import _bits
from miles_quant._spec import ELEMENTS

# torchao is a pinned test requirement (requirements-dev.txt): the oracle must run, not skip.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats import mx_tensor as torchao_mx
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    from torchao.prototype.mx_formats.utils import to_blocked

MX = {
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
    "mxfp4": torch.float4_e2m1fn_x2,
}
MODES = {
    "floor": ScaleCalculationMode.FLOOR,
    "even": ScaleCalculationMode.EVEN,
    "rceil": ScaleCalculationMode.RCEIL,
}


def _blocks_with_every_amax() -> torch.Tensor:
    """[N, 32] bf16 blocks: for every positive finite bf16 value a, one block whose amax is a
    (the other 31 elements are a times random factors in (-1, 1)), in random order."""
    v = all_bf16()
    pos = v[(v.float() > 0) & torch.isfinite(v.float())]
    g = torch.Generator().manual_seed(0)
    frac = torch.rand(pos.numel(), 31, generator=g) * 2 - 1
    rest = (pos.float().unsqueeze(1) * frac).to(torch.bfloat16)
    blocks = torch.cat([pos.unsqueeze(1), rest], dim=1)
    # Put the amax at a random position in its block.
    perm = torch.argsort(torch.rand(blocks.shape, generator=g), dim=1)
    return torch.gather(blocks, 1, perm)[torch.randperm(pos.numel(), generator=g)]


def _torchao_mx(x: torch.Tensor, fmt: str, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, d = torchao_mx.to_mx(x, MX[fmt], 32, MODES[rule])
    return s.view(torch.uint8), d.view(torch.uint8)


def _per_block(t: torch.Tensor, n_blocks: int) -> torch.Tensor:
    return t.reshape(n_blocks, -1)


@pytest.mark.parametrize("fmt", sorted(MX))
@pytest.mark.parametrize("rule", ["floor", "even"])
def test_mx_floor_and_even_equal_torchao_except_code_zero_blocks(fmt: str, rule: str) -> None:
    x = _blocks_with_every_amax()
    q = mq.quantize(x, fmt, scale_rule=rule)
    ao_s, ao_d = _torchao_mx(x, fmt, rule)
    ours_s = q.scales.view(torch.uint8).reshape(-1)
    # Scales: identical on every block (FLOOR/EVEN of every positive finite bf16 amax).
    assert torch.equal(ours_s, ao_s.reshape(-1))
    # Elements: identical except in blocks with scale code 0 (2^-127), where torchao divides
    # by its clamp 2^-126 instead (documented difference).
    n = x.shape[0]
    diff = (_per_block(bits(q.data), n) != _per_block(ao_d, n)).any(dim=1)
    assert not diff[ours_s != 0].any()
    assert (ours_s == 0).any()


@pytest.mark.parametrize("fmt", sorted(MX))
def test_mx_rceil_equals_torchao_on_its_exact_range(fmt: str) -> None:
    # torchao's RCEIL computes ceil(log2(amax / max)) with a float32 log2, which is one step low
    # when amax / max lies just above a power of two; and it uses the factor 1.0 for code 0.
    el = ELEMENTS[{"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}[fmt]]
    # fp32 blocks whose amax is max_elem * 2^k * (1 + j ulp): descale just above 2^k.
    g = torch.Generator().manual_seed(4)
    k = torch.arange(-100, 100, dtype=torch.float64).repeat_interleave(4)
    j = torch.arange(1, 5, dtype=torch.float64).repeat(200)
    amax = (el.max_value * torch.exp2(k) * (1 + j * 2.0**-23)).to(torch.float32)
    near = amax.unsqueeze(1) * (torch.rand(amax.numel(), 32, generator=g) * 2 - 1)
    near[:, 0] = amax
    x = torch.cat([_blocks_with_every_amax().float(), near])
    q = mq.quantize(x, fmt, scale_rule="rceil")
    ao_s, ao_d = _torchao_mx(x, fmt, "rceil")
    ours_s = q.scales.view(torch.uint8).reshape(-1).to(torch.int64)
    ao_s = ao_s.reshape(-1).to(torch.int64)
    amax = x.float().abs().amax(dim=1)
    descale = amax / el.max_value
    ao_formula = torch.clamp(torch.ceil(torch.log2(descale)), -127, 127) + 127
    log2_rounds_down = ao_formula != _bits.e8m0_rceil(_bits.f32_bits(amax), el)
    exact = ~log2_rounds_down & (ours_s != 0)
    assert torch.equal(ours_s[~log2_rounds_down], ao_s[~log2_rounds_down])
    assert torch.equal(ours_s[log2_rounds_down], ao_s[log2_rounds_down] + 1)
    assert log2_rounds_down.any()
    n = x.shape[0]
    same = (_per_block(bits(q.data), n) == _per_block(ao_d, n)).all(dim=1)
    assert same[exact].all()


def test_nvfp4_equals_torchao_two_level() -> None:
    g = torch.Generator().manual_seed(1)
    for x in (
        torch.randn(128, 256, generator=g).to(torch.bfloat16),
        (torch.randn(64, 512, generator=g) * torch.logspace(-4, 4, 512)).to(torch.bfloat16),
        torch.randn(32, 64, generator=g) * 1e-3,
        _blocks_with_every_amax()[:8192].reshape(-1, 64),
    ):
        q = mq.quantize(x, "nvfp4")
        amax = x.float().abs().amax()
        pts = per_tensor_amax_to_scale(amax)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s, d = nvfp4_quantize(x, 16, pts)
        assert q.global_scale is not None
        assert torch.equal(bits(q.global_scale), bits(pts))
        assert torch.equal(bits(q.scales), bits(s))
        assert torch.equal(bits(q.data), bits(d))
        # Dequantization: torchao multiplies by (global * block scale), as we do.
        ours = mq.dequantize(q, torch.float32)
        want = _bits.decode(mq.unpack_fp4(d, x.shape[-1]), ELEMENTS["e2m1"]) * (
            pts * s.float()
        ).repeat_interleave(16, dim=-1)
        assert torch.equal(bits(ours), bits(want))


# ---- FP8: the SGLang / vLLM / DeepSeek-V3 formula with torch's saturating cast ------------------


def _fp8_formula(
    x: torch.Tensor, tr: int, tc: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = max(amax, 1e-10) / fp8_max per tile; q = clamp(x / s, -max, max).to(fp8)."""
    fmax = torch.finfo(dtype).max
    r, c = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -c % tc, 0, -r % tr))
    tiles = xp.view(xp.shape[0] // tr, tr, xp.shape[1] // tc, tc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.clamp(amax, min=1e-10) / fmax
    q = torch.clamp(tiles / s, -fmax, fmax).to(dtype)
    q = q.reshape(xp.shape)[:r, :c]
    return q, s.reshape(s.shape[0], s.shape[2])


@pytest.mark.parametrize(
    ("fmt", "gran", "tile"),
    [
        ("fp8_e4m3", "1x128", (1, 128)),
        ("fp8_e4m3", "channel", (1, 10**9)),
        ("fp8_e4m3", "tensor", (10**9, 10**9)),
        ("fp8_e5m2", "1x128", (1, 128)),
        ("fp8_block128", "128x128", (128, 128)),
    ],
)
def test_fp8_equals_the_engine_formula(fmt: str, gran: str, tile: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 700, generator=g) * torch.logspace(-3, 3, 700)).to(torch.bfloat16)
    x[:, 128:256] = 0  # all-zero groups: the 1e-10 floor
    q = mq.quantize(x, fmt, granularity=gran)
    dtype = q.data.dtype
    tr, tc = min(tile[0], x.shape[0]), min(tile[1], x.shape[1])
    want_q, want_s = _fp8_formula(x, tr, tc, dtype)
    assert torch.equal(bits(q.data), bits(want_q))
    assert torch.equal(bits(q.scales), bits(want_s))


# ---- swizzled scales ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (300, 7), (1, 1), (129, 5), (64, 448)])
def test_swizzle_equals_torchao_to_blocked(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(3)
    s = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
    ours = mq.swizzle_scales(s)
    assert torch.equal(ours.reshape(-1), to_blocked(s))
    assert torch.equal(mq.unswizzle_scales(ours, *shape), s)


# ---- where the contract deliberately differs from torchao (docs/contract.md, section 6) ------


@pytest.mark.parametrize("fmt", sorted(MX))
def test_non_finite_blocks_poison_where_torchao_saturates(fmt: str) -> None:
    el = ELEMENTS[{"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}[fmt]]
    x = torch.ones(3, 32)
    x[0, 3] = float("inf")
    x[1, 5] = float("nan")
    # torchao: an Inf block gets FLOOR code 255 - emax (RCEIL 254) and Inf becomes +max; a NaN
    # block gets the NaN scale. We poison both: scale 0xFF, the element NaN code (or +0).
    s_floor, d_floor = _torchao_mx(x, fmt, "floor")
    s_rceil, _ = _torchao_mx(x, fmt, "rceil")
    assert s_floor[:2, 0].tolist() == [255 - el.emax, 255]
    assert s_rceil[:2, 0].tolist() == [254, 255]
    if el.torch_dtype is not None:
        assert d_floor[0, 3].item() == el.max_code
    for rule in ("floor", "rceil", "even"):
        q = mq.quantize(x, fmt, scale_rule=rule)
        s_ao, d_ao = _torchao_mx(x, fmt, rule)
        assert bits(q.scales).reshape(3, -1)[:2, 0].tolist() == [255, 255]
        # The finite block is the same as torchao's.
        assert bits(q.scales)[-1].item() == s_ao.reshape(-1)[-1].item()
        assert torch.equal(bits(q.data[2]), d_ao[2].reshape(-1))
        codes = q.data.view(torch.uint8)[:2]
        assert (codes == (el.nan_code if el.torch_dtype is not None else 0)).all()
        assert torch.isnan(mq.dequantize(q)[:2]).all()


def test_an_all_zero_tensor_gets_finite_nvfp4_scales_where_torchao_gets_nan() -> None:
    z = torch.zeros(4, 32)
    pts = per_tensor_amax_to_scale(z.abs().amax())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, _ = nvfp4_quantize(z, 16, pts)
    assert pts.item() == 0
    assert torch.isnan(s.float()).all()  # 0 / 0 block scales
    q = mq.quantize(z, "nvfp4")
    assert q.global_scale is not None
    assert q.global_scale.item() == torch.tensor(1e-10 / 2688, dtype=torch.float32).item()
    assert (bits(q.scales) == 0x08).all()  # the 2^-6 block-scale floor
    assert (q.data == 0).all()
    assert torch.equal(mq.dequantize(q), z)
