"""miles_quant.qat: INT4 fake quantization with a straight-through estimator.

Forward: bit for bit the quantize-then-dequantize of the contract, with the scale rounded to
its storage dtype first (checked against the formula written out here). Backward: exactly the
identity. Export of a QAT-trained model to compressed-tensors W4A16 reproduces its codes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _checkpoint_testlib import build, qwen3_moe_config, save
from _quant_testlib import same_bits

import miles_quant as mq
from miles_quant.checkpoint import export_checkpoint, load_quantized
from miles_quant.qat import apply_int4_qat, fake_quantize_int4

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _formula(w: torch.Tensor, group: int) -> torch.Tensor:
    """The INT4 rule of docs/contract.md in plain torch (no miles_quant); integer codes, so a
    negative value that rounds to 0 dequantizes to +0."""
    x = w.float().reshape(*w.shape[:-1], -1, group)
    s = torch.clamp(x.abs().amax(-1, keepdim=True) / 7.0, min=1e-5).to(w.dtype).float()
    q = torch.clamp(torch.round(torch.clamp(x / s, -8.0, 8.0)), -7, 7).to(torch.int32)
    return (q.float() * s).reshape(w.shape).to(w.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128])
def test_forward_is_quantize_then_dequantize(dtype: torch.dtype, group: int) -> None:
    torch.manual_seed(0)
    w = (torch.randn(3, 64, 256) * torch.rand(3, 64, 1) * 4).to(dtype)
    w[0, 0, :group] = 0.0  # an all-zero group
    got = fake_quantize_int4(w, group=group)
    q = mq.quantize(w, f"int4_g{group}")
    assert q.scales.dtype == dtype  # the scale keeps the weight's dtype
    assert same_bits(got, mq.dequantize(q, dtype))
    assert same_bits(got, _formula(w, group))
    assert same_bits(got, fake_quantize_int4(w, group=group, backend="torch"))


def test_scale_storage_dtype_matters() -> None:
    torch.manual_seed(1)
    w = torch.randn(256, 1024, dtype=torch.bfloat16)
    bf16_scale = fake_quantize_int4(w)
    fp32_scale = fake_quantize_int4(w, scale_dtype=torch.float32)
    codes = mq.unpack_int4(mq.quantize(w, "int4_g128").data, 1024)
    codes32 = mq.unpack_int4(mq.quantize(w, "int4_g128", scale_dtype=torch.float32).data, 1024)
    changed = float((codes != codes32).float().mean())
    assert 0.0 < changed < 0.02  # about 0.3% of codes: why the stored dtype is the contract's
    assert not torch.equal(bf16_scale, fp32_scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_is_exactly_the_identity(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    w = torch.randn(32, 128, dtype=dtype, requires_grad=True)
    upstream = torch.randn(32, 128, dtype=dtype)
    (fake_quantize_int4(w) * upstream).sum().backward()
    assert w.grad is not None
    assert same_bits(w.grad, upstream)


def _moe() -> torch.nn.Module:
    return build(qwen3_moe_config())


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def test_apply_on_fused_experts_equals_substituted_weights() -> None:
    model = _moe()
    handle = apply_int4_qat(model)
    assert handle.targets == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    ]
    out = model(input_ids=_ids()).logits
    out.float().square().sum().backward()
    # Reference: the same model with the fake-quantized weights written into it.
    ref = copy.deepcopy(model)
    ref.zero_grad()
    with torch.no_grad():
        for name in handle.targets:
            p = ref.get_parameter(name)
            p.copy_(mq.dequantize(mq.quantize(p, "int4_g128"), p.dtype))
    handle.remove()
    ref_out = ref(input_ids=_ids()).logits
    assert same_bits(out, ref_out)
    ref_out.float().square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert same_bits(p.grad, ref.get_parameter(name).grad), name  # identity through STE
    # Removed: the plain forward again, and the parameters were never changed.
    plain = model(input_ids=_ids()).logits
    assert not torch.equal(plain, out)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


class _Experts(torch.nn.Module):
    """Per-expert nn.Linear modules (the other common MoE layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(128, 64) for _ in range(3))
        self.gate = torch.nn.Linear(128, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts) + self.gate(x).sum(-1, keepdim=True)  # type: ignore[return-value]


def test_apply_on_linear_experts_and_patterns() -> None:
    torch.manual_seed(4)
    m = _Experts()
    x = torch.randn(5, 128)
    handle = apply_int4_qat(m, patterns=["experts"], group=32)
    assert handle.targets == [f"experts.{i}.weight" for i in range(3)]  # not biases, not gate
    got = m(x)
    want = sum(
        torch.nn.functional.linear(x, fake_quantize_int4(e.weight, group=32), e.bias)
        for e in m.experts
    ) + m.gate(x).sum(-1, keepdim=True)
    assert same_bits(got, want)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already applied"):
        apply_int4_qat(m, patterns=["experts"])
    handle.remove()
    apply_int4_qat(m, patterns=["re:^gate\\."], group=128).remove()


def test_errors() -> None:
    m = _Experts()
    with pytest.raises(ValueError, match=r"no parameter matches \['\*\.experts\.\*'\]"):
        apply_int4_qat(m)  # the default pattern needs a dot before "experts"
    with pytest.raises(ValueError, match="group must be one of"):
        apply_int4_qat(m, patterns=["experts"], group=64)
    with pytest.raises(ValueError, match="last dim must be a multiple of the group"):
        apply_int4_qat(torch.nn.Sequential(torch.nn.Linear(96, 8)), patterns=["0"])
    with pytest.raises(ValueError, match="bad regular expression"):
        apply_int4_qat(m, patterns=["re:["])
    # A bare string is not iterated character by character (its "*" would select everything).
    with pytest.raises(ValueError, match="got the string"):
        apply_int4_qat(m, patterns="*.experts.*")


def test_forward_error_restores_parameters() -> None:
    m = _Experts()
    handle = apply_int4_qat(m, patterns=["experts"])
    with pytest.raises(RuntimeError):
        m(torch.randn(5, 7))  # wrong input width
    assert all(type(e.weight) is torch.nn.Parameter for e in m.experts)
    handle.remove()


def test_export_of_qat_model_reproduces_its_codes(tmp_path: Path) -> None:
    model = _moe()
    handle = apply_int4_qat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(input_ids=_ids()).logits.float().square().mean().backward()
    opt.step()  # a QAT training step moves the weights
    handle.remove()
    src = save(model, tmp_path / "trained")  # bf16, per-expert names on disk
    out = tmp_path / "w4a16"
    export_checkpoint(src, out, "int4_g128", only=handle.patterns)
    state = load_quantized(out, dequantize=False)
    inter = qwen3_moe_config().moe_intermediate_size
    checked = 0
    for name in handle.targets:
        w = model.get_parameter(name).detach()
        fq = fake_quantize_int4(w)  # what the QAT forward computes with
        layer, _, leaf = name.rpartition(".")
        for e in range(w.shape[0]):
            parts = (
                {"down_proj": w[e]}
                if leaf == "down_proj"
                else {"gate_proj": w[e, :inter], "up_proj": w[e, inter:]}
            )
            rows = {"down_proj": fq[e], "gate_proj": fq[e, :inter], "up_proj": fq[e, inter:]}
            for part, x in parts.items():
                q = state[f"{layer}.{e}.{part}.weight"]
                assert isinstance(q, mq.QuantizedTensor)
                assert same_bits(q.data, mq.quantize(x, "int4_g128").data)
                assert same_bits(mq.dequantize(q, torch.bfloat16), rows[part])
                checked += 1
    assert checked == 2 * 4 * 3
