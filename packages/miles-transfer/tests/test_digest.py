"""tensor_digest: equal iff dtype, shape and bits are equal."""

from __future__ import annotations

import hashlib

import pytest
import torch

from miles_transfer import tensor_digest


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_signed_zeros_differ():
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))


def test_nan_payloads_differ_and_equal_nans_match():
    a, b = _f32(0x7FC00000), _f32(0x7FC00001)
    assert torch.isnan(a).all()
    assert torch.isnan(b).all()
    assert tensor_digest(a) != tensor_digest(b)
    assert tensor_digest(a) == tensor_digest(_f32(0x7FC00000))


def test_bf16_one_ulp_differs():
    x = torch.tensor([1.0], dtype=torch.bfloat16)
    y = x.view(torch.int16).add(1).view(torch.bfloat16)
    assert tensor_digest(x) != tensor_digest(y)
    assert tensor_digest(x) == tensor_digest(torch.tensor([1.0]).to(torch.bfloat16))


def test_dtype_and_shape_are_part_of_the_digest():
    z = torch.zeros(4, dtype=torch.int32)
    assert tensor_digest(z) != tensor_digest(z.view(torch.float32))  # same bytes
    assert tensor_digest(z) != tensor_digest(z.view(2, 2))
    assert tensor_digest(torch.empty(0, 3)) != tensor_digest(torch.empty(3, 0))


def test_layout_does_not_matter_only_values():
    x = torch.arange(12.0).view(3, 4)
    assert tensor_digest(x.t()) == tensor_digest(x.t().contiguous())
    assert tensor_digest(x[:, 1]) == tensor_digest(x[:, 1].clone())


def test_random_bit_flips_always_change_the_digest():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(257, generator=g).to(torch.bfloat16)
    ref = tensor_digest(base)
    for i in range(0, 257, 16):
        flipped = base.clone()
        flipped.view(torch.int16)[i] ^= 1 << (i % 16)
        assert tensor_digest(flipped) != ref


def test_digest_format_is_the_documented_blake2b():
    t = torch.tensor([1.5, -2.0], dtype=torch.float16)
    h = hashlib.blake2b(digest_size=16)
    h.update(b"torch.float16|(2,)|")
    h.update(bytes(t.view(torch.uint8).tolist()))
    assert tensor_digest(t) == h.hexdigest()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int8])
def test_one_byte_dtypes(dtype):
    t = torch.zeros(5, dtype=dtype)
    assert len(tensor_digest(t)) == 32
