"""The native bf16 RMSNorm (miles_rollout._ext) gives PyTorch's bits exactly.

The kernel reproduces the float operations of ``w * F.rms_norm(x, None, eps)`` in bf16,
including PyTorch's summation order of the squares; every case below is compared bit for bit,
on rows of very different scales and sizes that exercise the reduction's cascade (1024+).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_rollout import _native
from miles_rollout._rms_norm import native_rms_norm, native_rms_norm_is_exact, torch_rms_norm

needs_native = pytest.mark.skipif(_native.ext is None, reason=f"no native kernel: {_native.error}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 4, n)[:, None]
    return (torch.randn(n, d, generator=gen) * scale).bfloat16()


@needs_native
@pytest.mark.parametrize("d", [16, 64, 128, 384, 1024, 2048, 4096, 5120])
def test_rows_equal_torch_bit_for_bit(d: int) -> None:
    x = _rows(96, d, seed=d)
    w = torch.randn(d, generator=torch.Generator().manual_seed(1)).bfloat16()
    for eps in (1e-6, 1e-5):
        got = native_rms_norm(x, w, eps)
        assert got is not None
        assert torch.equal(_bits(got), _bits(torch_rms_norm(x, w, eps)))
    assert native_rms_norm_is_exact(d, 1e-6)


@needs_native
def test_engine_layouts_equal_torch_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, kv, hd, width = 13, 6, 2, 64, 9
    # Decode: q/k rows of the fused qkv output, one weight row per head.
    qkv = (torch.randn(n, (heads + 2 * kv) * hd, generator=gen) * 3).bfloat16()
    qk = qkv[:, : (heads + kv) * hd].view(n, heads + kv, hd)
    w_heads = torch.randn(hd, generator=gen).bfloat16().expand(heads + kv, -1).contiguous()
    got = native_rms_norm(qk, w_heads, 1e-6)
    assert got is not None
    assert got.shape == qk.shape
    assert torch.equal(_bits(got), _bits(torch_rms_norm(qk, w_heads, 1e-6)))
    # Prefill: [m, W, H, D] views of a [m, W, (H + 2KV) * D] projection, one [D] weight.
    proj = (torch.randn(n, width, (heads + 2 * kv) * hd, generator=gen)).bfloat16()
    q = proj[..., : heads * hd].view(n, width, heads, hd)
    w = torch.randn(hd, generator=gen).bfloat16()
    got = native_rms_norm(q, w, 1e-6)
    assert got is not None
    assert torch.equal(_bits(got), _bits(torch_rms_norm(q, w, 1e-6)))
    # Hidden rows [m, W, hidden].
    h = (torch.randn(n, width, 384, generator=gen) * 10).bfloat16()
    wh = torch.randn(384, generator=gen).bfloat16()
    got = native_rms_norm(h, wh, 1e-6)
    assert got is not None
    assert torch.equal(_bits(got), _bits(torch_rms_norm(h, wh, 1e-6)))


@needs_native
def test_every_isa_variant_gives_the_same_bits() -> None:
    ext = _native.ext
    assert ext is not None
    x = _rows(40, 1024, seed=3)
    w = torch.randn(1024, generator=torch.Generator().manual_seed(4)).bfloat16()
    start = ext.kernel_isa()
    outs = {}
    try:
        for isa in ("avx512", "avx2", "generic"):
            if ext.use_isa(isa):
                outs[isa] = native_rms_norm(x, w, 1e-6)
    finally:
        assert ext.use_isa(start)
    want = _bits(torch_rms_norm(x, w, 1e-6))
    assert "generic" in outs
    for isa, out in outs.items():
        assert out is not None
        assert torch.equal(_bits(out), want), isa


def test_operands_the_kernel_does_not_take_return_none(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _rows(4, 64, seed=5)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert native_rms_norm(x.float(), w.float(), 1e-6) is None  # float32
    assert native_rms_norm(x[:, :40], w[:40], 1e-6) is None  # D not a multiple of 16
    assert native_rms_norm(x.t().contiguous().t(), w, 1e-6) is None  # D not contiguous
    assert native_rms_norm(x, torch.ones(3, 64, dtype=torch.bfloat16), 1e-6) is None
    assert native_rms_norm(x[None, None, None], w, 1e-6) is None  # 5-D
    monkeypatch.setattr(_native, "ext", None)
    assert native_rms_norm(x, w, 1e-6) is None
    native_rms_norm_is_exact.cache_clear()
    try:
        assert not native_rms_norm_is_exact(64, 1e-6)
    finally:
        native_rms_norm_is_exact.cache_clear()


@needs_native
def test_runner_norms_change_no_bits(model_dir: Path) -> None:
    """With the attention on PyTorch, native norms leave prefill and decode logits bit-equal."""
    from transformers import AutoModelForCausalLM

    from miles_rollout._model import CausalLMRunner

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    runs = []
    for backend in ("native", "torch"):
        runner = CausalLMRunner(hf, max_batch=8, context_length=64, kernel_backend=backend)
        assert bool(runner._native_norm_sizes) == (backend == "native")
        runner.native_attention = False  # isolate the norms
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 100, (m,), generator=gen).tolist() for m in (5, 9, 2)]
        with torch.inference_mode():
            first = runner.prefill(0, prompts)
            tokens = first.argmax(-1)
            positions = torch.tensor([len(p) for p in prompts])
            steps = [first]
            for _ in range(8):
                logits = runner.decode(tokens, positions, int(positions.max()) + 1)
                steps.append(logits)
                tokens, positions = logits.argmax(-1), positions + 1
        runs.append(torch.stack(steps))
    assert torch.equal(runs[0], runs[1])
