"""The native decode attention (miles_rollout._ext; bf16, and fp32 below) against PyTorch.

Measured on random inputs (q, K, V ~ N(0, 1) in bf16, ragged lengths up to 160, n up to 64;
seeds below): 99.99% of outputs are bit-equal to the torch path; every difference is at most
half a bf16 ulp of the magnitude of the summed terms (sum_t p_t |v_t|), and 1 ulp of the
value itself wherever the output is not the small remainder of a cancelling sum. Where they
differ: the kernel and oneDNN add the float32 dot products and the p @ V sums in different
orders, and the kernel's exp (its own polynomial) can differ from torch's by an fp32 ulp; either
moves a value across a bf16 rounding boundary now and then (a score or a probability by one
bf16 ulp). The kernel's own variants (AVX-512, AVX2, portable) agree bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_rollout import _native
from miles_rollout._decode_attention import decode_attention, eager_attention

needs_native = pytest.mark.skipif(_native.ext is None, reason=f"no native kernel: {_native.error}")


def _inputs(
    n: int, kv: int, g: int, d: int, t_cap: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # q as the engine passes it: a strided view of the fused [n, heads + kv heads, d] rows.
    qk = torch.randn(n, kv * g + kv, d, generator=gen).bfloat16()
    q = qk[:, : kv * g].reshape(n, kv, g, d)
    k = torch.randn(n + 2, kv, t_cap, d, generator=gen).bfloat16()
    v = torch.randn(n + 2, kv, t_cap, d, generator=gen).bfloat16()
    lengths = torch.randint(1, t_cap + 1, (n,), generator=gen)
    lengths[0] = t_cap  # one full row
    return q, k, v, lengths


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.float().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


def _term_magnitude(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """sum_t p_t |v_t| with the torch path's probabilities: the scale of each output's sum."""
    n, d = q.shape[0], q.shape[-1]
    width = int(lengths.max())
    hidden = (torch.arange(width)[None, :] >= lengths[:, None])[:, None, None, :]
    s = torch.matmul(q, k[:n, :, :width].transpose(-2, -1)) * d**-0.5
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), -1, dtype=torch.float32)
    return torch.matmul(p.bfloat16().float(), v[:n, :, :width].float().abs())


@needs_native
@pytest.mark.parametrize(("g", "d"), [(1, 64), (3, 64), (4, 64), (3, 128), (4, 128), (1, 128)])
@pytest.mark.parametrize("n", [1, 5, 64])
def test_native_matches_the_torch_eager_path(g: int, d: int, n: int) -> None:
    q, k, v, lengths = _inputs(n, 2, g, d, 160, seed=1000 * g + d + n)
    ref = decode_attention(q, k, v, lengths, d**-0.5, backend="torch")
    out = decode_attention(q, k, v, lengths, d**-0.5, backend="native")
    assert out.shape == ref.shape == (n, 2, g, d)
    assert out.dtype == torch.bfloat16
    assert out.is_contiguous()
    diff = (out.float() - ref.float()).abs()
    unequal = (diff > 0).float().mean().item()
    assert unequal < 2e-3, f"{unequal:.2%} of outputs differ"
    mag = _term_magnitude(q, k, v, lengths)
    assert bool((diff <= mag * 2.0**-8).all()), (diff / (mag * 2.0**-8)).max().item()
    big = torch.maximum(out.float().abs(), ref.float().abs())
    not_cancelled = ref.float().abs() >= mag / 4
    one_ulp = diff <= _bf16_ulp(big)
    assert bool(one_ulp[not_cancelled].all()), (diff / _bf16_ulp(big))[not_cancelled].max()


@needs_native
@pytest.mark.parametrize(("g", "d"), [(3, 64), (4, 128), (5, 16), (2, 48)])
def test_every_isa_variant_gives_the_same_bits(g: int, d: int) -> None:
    ext = _native.ext
    assert ext is not None
    q, k, v, lengths = _inputs(9, 2, g, d, 70, seed=g + d)
    start = ext.kernel_isa()
    outs = {}
    try:
        for isa in ("avx512", "avx2", "generic"):
            if ext.use_isa(isa):
                outs[isa] = decode_attention(q, k, v, lengths, d**-0.5, backend="native")
    finally:
        assert ext.use_isa(start)
    assert "generic" in outs
    first = next(iter(outs.values())).view(torch.int16)
    for isa, out in outs.items():
        assert torch.equal(out.view(torch.int16), first), isa


@needs_native
def test_only_live_positions_are_read() -> None:
    q, k, v, lengths = _inputs(6, 2, 3, 64, 48, seed=7)
    lengths[:] = torch.tensor([48, 1, 17, 16, 33, 2])
    out = decode_attention(q, k, v, lengths, 0.125, backend="native")
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        k2[b, :, n:] = float("nan")
        v2[b, :, n:] = float("inf")
    k2[6:], v2[6:] = float("nan"), float("nan")  # rows past n
    again = decode_attention(q, k2, v2, lengths, 0.125, backend="native")
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    # A single live position: softmax is exactly 1, the output is that value.
    assert torch.equal(out[1].view(torch.int16), v[1, :, :1].expand(2, 3, 64).view(torch.int16))


@needs_native
@pytest.mark.parametrize(("g", "d"), [(1, 16), (3, 64), (4, 128)])
def test_float32_kernel_reads_rows_per_query_and_is_position_invariant(g: int, d: int) -> None:
    """fp32 (the batch-invariant engine's attention): close to the eager maths, the same bits
    on every instruction set, and each query's output independent of the others in the call
    (the property prefix-cache hits rely on)."""
    ext = _native.ext
    assert ext is not None
    gen = torch.Generator().manual_seed(g * d)
    n, kv, t_cap = 23, 2, 70
    qk = torch.randn(n, kv * g + kv, d, generator=gen)
    q = qk[:, : kv * g].reshape(n, kv, g, d)
    k = torch.randn(5, kv, t_cap, d, generator=gen)
    v = torch.randn(5, kv, t_cap, d, generator=gen)
    lengths = torch.randint(1, t_cap + 1, (n,), generator=gen)
    rows = torch.randint(0, 5, (n,), generator=gen)
    out = decode_attention(q, k, v, lengths, d**-0.5, rows=rows, backend="native")
    ref = decode_attention(q, k, v, lengths, d**-0.5, rows=rows, backend="torch")
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 2e-6
    alone = [
        decode_attention(q[i : i + 1], k, v, lengths[i : i + 1], d**-0.5, rows=rows[i : i + 1])
        for i in range(n)
    ]
    assert torch.equal(torch.cat(alone), out)
    start = ext.kernel_isa()
    try:
        for isa in ("avx2", "generic"):
            if ext.use_isa(isa):
                again = decode_attention(q, k, v, lengths, d**-0.5, rows=rows, backend="native")
                assert torch.equal(again, out), isa
    finally:
        assert ext.use_isa(start)
    bad = rows.clone()
    bad[3] = 5
    with pytest.raises(ValueError, match=r"rows\[3\] = 5"):
        decode_attention(q, k, v, lengths, d**-0.5, rows=bad, backend="native")


def test_bad_arguments_raise_clear_errors() -> None:
    q, k, v, lengths = _inputs(3, 2, 3, 64, 32, seed=3)
    for backend in ("auto", "torch") + (("native",) if _native.ext is not None else ()):
        bad = lengths.clone()
        bad[2] = 33
        with pytest.raises(ValueError, match=r"\[1, 32\]"):
            decode_attention(q, k, v, bad, 0.125, backend=backend)
        bad[2] = 0
        with pytest.raises(ValueError, match=r"\[1, 32\]"):
            decode_attention(q, k, v, bad, 0.125, backend=backend)
    with pytest.raises(ValueError, match="int64"):
        decode_attention(q, k, v, lengths.int(), 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(q, k[:, :1], v[:, :1], lengths, 0.125)
    k_t = k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, strided
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q, k_t, v, lengths, 0.125)
    with pytest.raises(ValueError, match="backend"):
        decode_attention(q, k, v, lengths, 0.125, backend="fast")


def test_missing_extension_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, lengths = _inputs(4, 2, 3, 64, 40, seed=5)
    ref = decode_attention(q, k, v, lengths, 0.125, backend="torch")
    monkeypatch.setattr(_native, "ext", None)
    monkeypatch.setattr(_native, "error", "ImportError: not built (test)")
    out = decode_attention(q, k, v, lengths, 0.125)  # auto
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    with pytest.raises(ValueError, match="not built"):
        decode_attention(q, k, v, lengths, 0.125, backend="native")
    # Without the kernel float32 takes the torch path: the eager maths with a length mask.
    qf, kf, vf = q.float(), k.float(), v.float()
    width = int(lengths.max())
    hidden = (torch.arange(width)[None, :] >= lengths[:, None])[:, None, None, :]
    want = eager_attention(qf, kf[:4, :, :width], vf[:4, :, :width], 0.125, hidden)
    assert torch.equal(decode_attention(qf, kf, vf, lengths, 0.125), want)


def _runner_logits(model_dir: Path, backend: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from miles_rollout._model import CausalLMRunner

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    runner = CausalLMRunner(hf, max_batch=8, context_length=64, kernel_backend=backend)
    assert runner.native_attention == (backend == "native")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (m,), generator=gen).tolist() for m in (5, 9, 2, 30)]
    with torch.inference_mode():
        first = runner.prefill(0, prompts)
        tokens = first.argmax(-1)
        positions = torch.tensor([len(p) for p in prompts])
        steps = [first]
        for _ in range(20):
            logits = runner.decode(tokens, positions, int(positions.max()) + 1)
            steps.append(logits)
            tokens, positions = logits.argmax(-1), positions + 1
    return torch.stack(steps)


@needs_native
def test_runner_decodes_the_same_with_either_backend(model_dir: Path) -> None:
    native = _runner_logits(model_dir, "native")
    torch_ = _runner_logits(model_dir, "torch")
    # Same greedy tokens; logits equal up to the rare 1-ulp attention differences.
    assert torch.equal(native.argmax(-1), torch_.argmax(-1))
    assert (native - torch_).abs().max().item() < 2e-2


def test_runner_backend_choice(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from miles_rollout._model import CausalLMRunner

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with pytest.raises(ValueError, match="kernel_backend"):
        CausalLMRunner(hf, max_batch=2, context_length=32, kernel_backend="fast")
    auto = CausalLMRunner(hf, max_batch=2, context_length=32)
    assert auto.native_attention == (_native.ext is not None)
    monkeypatch.setattr(_native, "ext", None)
    assert not CausalLMRunner(hf, max_batch=2, context_length=32).native_attention
    with pytest.raises(ValueError, match=r"miles_rollout\._ext"):
        CausalLMRunner(hf, max_batch=2, context_length=32, kernel_backend="native")
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert not CausalLMRunner(hf32, max_batch=2, context_length=32).native_attention


def test_engine_runs_without_the_extension(model_dir: Path) -> None:
    """MILES_ROLLOUT_DISABLE_NATIVE=1 (as without a compiler): bf16 engine on the torch path."""
    code = (
        "import sys, torch\n"
        "from miles_rollout import EngineConfig, SamplingParams, _native\n"
        "assert _native.ext is None and 'MILES_ROLLOUT_DISABLE_NATIVE' in _native.error\n"
        "with EngineConfig(model_path=sys.argv[1], dtype='bfloat16').build() as eng:\n"
        "    assert not eng._runner.native_attention\n"
        "    out = eng.generate([5, 6, 7], SamplingParams(max_new_tokens=5, ignore_eos=True))\n"
        "    assert out.completion_tokens == 5\n"
        "print('ok')\n"
    )
    env = {"MILES_ROLLOUT_DISABLE_NATIVE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
