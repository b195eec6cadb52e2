"""The trainer's CPU attention for bf16 compute against torch SDPA and HF's eager attention."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from miles_trainer import FSDPTrainer, TrainerConfig
from miles_trainer.ops.attention import (
    GQA_EAGER,
    attn_implementation,
    causal_attention,
    eager_reference,
    gqa_eager_attention,
)

MODULE = SimpleNamespace(training=False, num_key_value_groups=3, is_causal=True)


def _qkv(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    B, H, KV, L, D = 2, 6, 2, 9, 16
    q, k, v = (torch.randn(B, n, L, D, generator=g) for n in (H, KV, KV))
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v))  # type: ignore[return-value]


def test_float32_matches_sdpa_with_gradients() -> None:
    q, k, v = _qkv(torch.float32)
    out, _ = gqa_eager_attention(MODULE, q, k, v, None, scaling=0.25)  # type: ignore[arg-type]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert out.shape == (2, 9, 6, 16)
    assert out.is_contiguous()
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.transpose(1, 2).square().sum(), (q, k, v))
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_hf_eager_attention() -> None:
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    q, k, v = _qkv(torch.bfloat16)
    L = q.shape[2]
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    low = torch.finfo(torch.bfloat16).min
    mask = torch.zeros(L, L, dtype=torch.bfloat16).masked_fill(future, low)[None, None]
    out, _ = gqa_eager_attention(MODULE, q, k, v, None, scaling=0.25)  # type: ignore[arg-type]
    want, _ = eager_attention_forward(MODULE, q, k, v, mask, scaling=0.25)  # type: ignore[arg-type]
    assert torch.equal(out, want)


def test_a_boolean_mask_is_applied_and_an_additive_one_goes_to_sdpa() -> None:
    """Packed batches hand a boolean [B, 1, L, L] mask (True: attend): the eager maths apply
    it, bit for bit HF's eager attention with the same mask; an additive mask goes to SDPA."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    keep = torch.ones(9, 9, dtype=torch.bool).tril()
    keep[4:, :4] = False  # two packed samples: positions 0-3 and 4-8
    q, k, v = _qkv(torch.bfloat16)
    out, _ = gqa_eager_attention(MODULE, q, k, v, keep[None, None], scaling=0.25)  # type: ignore[arg-type]
    low = torch.finfo(torch.bfloat16).min
    additive = torch.zeros(9, 9, dtype=torch.bfloat16).masked_fill(~keep, low)[None, None]
    want, _ = eager_attention_forward(MODULE, q, k, v, additive, scaling=0.25)  # type: ignore[arg-type]
    assert torch.equal(out, want)

    q, k, v = _qkv(torch.float32)
    additive32 = torch.zeros(9, 9).masked_fill(~keep, float("-inf"))[None, None]
    out, _ = gqa_eager_attention(MODULE, q, k, v, additive32, scaling=0.25)  # type: ignore[arg-type]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2).contiguous(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "device", "want"),
    [("float32", "cpu", "sdpa"), ("bfloat16", "cpu", GQA_EAGER), ("bfloat16", "cuda", "sdpa")],
)
def test_choice_by_dtype_and_device(dtype: str, device: str, want: str) -> None:
    got = attn_implementation(getattr(torch, dtype), torch.device(device))
    assert got == want


def test_bfloat16_trainer_uses_it(tiny_model_dir: Path) -> None:
    trainer = FSDPTrainer(TrainerConfig(model_path=str(tiny_model_dir), dtype="bfloat16"))
    # On CPU; a GPU machine (where the trainer takes cuda:LOCAL_RANK) keeps SDPA.
    want = GQA_EAGER if trainer.device.type == "cpu" else "sdpa"
    config: Any = trainer.model.config
    assert config._attn_implementation == want


@pytest.mark.parametrize("scaling", [0.25, 0.1])  # a power of two (folded into the matmuls), not
@pytest.mark.parametrize("packed", [False, True])
def test_causal_attention_function_is_autograds_bits(scaling: float, packed: bool) -> None:
    """The written-out forward and backward against autograd through the eager maths (the path
    before it): outputs and all three gradients bit for bit, with and without a packed mask."""
    mask = None
    if packed:
        mask = torch.ones(9, 9, dtype=torch.bool).tril()
        mask[5:, :5] = False  # two packed samples: positions 0-4 and 5-8
        mask = mask[None, None]
    q, k, v = _qkv(torch.bfloat16)
    q, k, v = (t[:1].detach().requires_grad_() for t in (q, k, v))  # a packed batch is one row
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(1, 9, 6, 16, generator=g).to(torch.bfloat16)
    got = causal_attention(q, k, v, mask, scaling)
    assert got is not None
    want = eager_reference(q, k, v, mask, scaling)
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


def test_per_sample_masks_fall_back_to_the_reference() -> None:
    q, k, v = _qkv(torch.bfloat16)
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    assert causal_attention(q, k, v, keep, 0.25) is None  # [B > 1, 1, L, L]: eager_reference
    out, _ = gqa_eager_attention(MODULE, q, k, v, keep, scaling=0.25)  # type: ignore[arg-type]
    assert torch.equal(out, eager_reference(q, k, v, keep, 0.25))
