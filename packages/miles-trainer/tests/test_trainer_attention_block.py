"""The fused attention block (`ops.attention_block`, `ops.rope`) against transformers' modules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_trainer.ops import use_fast_ops
from miles_trainer.ops.attention import attn_implementation
from miles_trainer.ops.attention_block import use_fast_attention_block
from miles_trainer.ops.rmsnorm import use_fast_rms_norm
from miles_trainer.ops.rope import rope_backward, rope_forward

BF16 = torch.bfloat16
B, L = 3, 11


def test_rope_is_hfs_bits_forward_and_backward() -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 4, L, 16, generator=g).to(BF16).requires_grad_()
    cos, sin = (torch.randn(B, L, 16, generator=g).to(BF16) for _ in range(2))
    dout = torch.randn(B, 4, L, 16, generator=g).to(BF16)
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    (want_dx,) = torch.autograd.grad(want, x, dout)
    got = rope_forward(x.detach(), cos[:, None], sin[:, None])
    assert torch.equal(got, want)
    assert torch.equal(rope_backward(dout, cos[:, None], sin[:, None]), want_dx)


def _attention(kind: str) -> Any:
    """A bf16 attention module of a tiny Qwen3 (q/k norms) or Llama (none), GQA 4:2."""
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    cfg_cls: Any = Qwen3Config if kind == "qwen3" else LlamaConfig
    attn_cls: Any = Qwen3Attention if kind == "qwen3" else LlamaAttention
    cfg = cfg_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=32,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    module = attn_cls(cfg, layer_idx=0).to(BF16)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p + 0.2 * torch.randn_like(p))  # norms away from 1
    return module


def _rope(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(L).expand(B, L).float()
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos().to(BF16), emb.sin().to(BF16)


def _with_gqa_eager(module: Any) -> Any:
    """A copy of ``module`` attending with the trainer's GQA eager attention."""
    out = copy.deepcopy(module)
    out.config = copy.deepcopy(module.config)
    out.config._attn_implementation = attn_implementation(BF16, torch.device("cpu"))
    return out


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fused_attention_block_is_hfs_forward_and_autograds_weight_gradients(kind: str) -> None:
    """Forward bit for bit HF's module with its eager attention; the weight gradients bit for
    bit autograd's through HF's module on the trainer's GQA eager attention (the path before;
    HF's ``repeat_kv`` sums the k/v gradients of grouped heads in another order), with the
    trainer's RMSNorm on every side; the input gradient, one matmul over the stacked q/k/v
    gradients, within bf16 rounding of the float64 one."""
    hf = _attention(kind)
    use_fast_rms_norm(hf)  # every side: the trainer's norm (its own tests pin it to HF's)
    before = _with_gqa_eager(hf)
    fused = _with_gqa_eager(hf)
    assert use_fast_attention_block(fused) == 1
    cos, sin = _rope(hf)
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(B, L, 64, generator=g)).to(BF16)
    dout = torch.randn(B, L, 64, generator=g).to(BF16)
    causal = torch.full((L, L), torch.finfo(BF16).min).triu(1).to(BF16)[None, None]

    def run(module: torch.nn.Module, mask: torch.Tensor | None) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_()
        out, _ = module(hidden_states=xi, position_embeddings=(cos, sin), attention_mask=mask)
        params = list(module.parameters())
        grads = torch.autograd.grad(out, [xi, *params], dout)
        return [out.detach(), *grads]

    eager, want, got = run(hf, causal), run(before, None), run(fused, None)
    assert torch.equal(got[0], eager[0])
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[2:], want[2:]):
        assert torch.equal(a, b)
    # The input gradient against float64 maths on the same bf16 inputs and weights.
    exact = copy.deepcopy(hf).double()
    for m in exact.modules():  # HF's own norms (the trainer's is a bf16-path function)
        m.__dict__.pop("forward", None)
    xi = x.double().requires_grad_()
    out, _ = exact(
        hidden_states=xi,
        position_embeddings=(cos.double(), sin.double()),
        attention_mask=torch.full((L, L), -torch.inf).triu(1).double()[None, None],
    )
    (dx64,) = torch.autograd.grad(out, xi, dout.double())
    scale = dx64.abs().max().item()
    err_got = (got[1].double() - dx64).abs().max().item() / scale
    err_before = (want[1].double() - dx64).abs().max().item() / scale
    assert err_got < 2e-2, err_got
    assert err_got <= 2 * err_before + 1e-3, (err_got, err_before)


def test_hooks_and_caches_take_hfs_forward() -> None:
    hf = _attention("qwen3")
    fused = _with_gqa_eager(hf)
    assert use_fast_attention_block(fused) == 1
    cos, sin = _rope(hf)
    x = torch.randn(B, L, 64).to(BF16)
    seen: list[str] = []
    handle = fused.q_proj.register_forward_pre_hook(lambda m, a: seen.append("q_proj"))
    with torch.no_grad():
        fused(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
    handle.remove()
    assert seen == ["q_proj"]  # HF's forward ran (a QAT hook would have swapped the weight)
    with torch.no_grad():
        fused(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
    assert seen == ["q_proj"]  # without the hook: the fused path, which calls no projection


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_use_fast_ops_keeps_a_qwen3s_logits(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    """bf16: HF's eager attention's logits; float32 (attention through HF's SDPA): HF's."""
    from transformers import AutoModelForCausalLM

    attn = attn_implementation(dtype, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=dtype, attn_implementation="eager" if dtype == BF16 else attn
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=dtype, attn_implementation=attn
    )
    n = model.config.num_hidden_layers
    assert use_fast_ops(model) == {"rms_norm": 4 * n + 1, "attention": n, "shared_prefix": 1}
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        want = hf(ids, use_cache=False).logits
        got = model(ids, use_cache=False).logits
    assert torch.equal(got, want)
