"""Activation calibration (miles_quant.calibrate) and the calibrated NVFP4 input_scale.

Oracles: the inputs each Linear received, captured by separate forward hooks, give the amax
by hand; ``fp32(amax) / 2688`` is checked against float64 division rounded once to fp32 (the
correctly rounded quotient), bit for bit; the exported ``input_scale`` tensors are read back
with safetensors itself.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _checkpoint_testlib import VOCAB, build, qwen3_config, qwen3_moe_config, read_all, save
from _quant_testlib import same_bits

import miles_quant as mq
from miles_quant.calibrate import (
    Calibration,
    calibrate_checkpoint,
    collect_input_amax,
    input_scale,
    read_prompts,
)
from miles_quant.checkpoint import export_checkpoint, load_quantized
from miles_quant.checkpoint_cli import main

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = string.ascii_letters + string.digits + " .,:!?\n"


def _tokenizer() -> Any:
    """A character-level HF fast tokenizer (offline) whose ids fit the tiny models' VOCAB."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL, *CHARS])}
    assert len(vocab) <= VOCAB
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL[0]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.add_special_tokens(SPECIAL)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=SPECIAL[2], pad_token=SPECIAL[0], chat_template=template
    )


def _batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 5 + 4 * i), generator=g)} for i in range(n)]


def _captured_inputs(model: torch.nn.Module, batches: list[Any]) -> dict[str, list[torch.Tensor]]:
    """Every input of every Linear, captured by plain forward hooks (not the code under test)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):

            def hook(m: Any, args: Any, out: Any, name: str = name) -> None:
                seen.setdefault(name, []).append(args[0].detach().clone())

            handles.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in handles:
        h.remove()
    return seen


def _by_hand(xs: list[torch.Tensor]) -> np.float32:
    """max |x| over all calls, computed in float64 from the inputs (exact), as fp32."""
    return np.float32(
        max(float(np.abs(x.detach().float().numpy().astype(np.float64)).max()) for x in xs)
    )


def _f32_bits(v: Any) -> int:
    return int(np.asarray(v, dtype=np.float32).view(np.uint32))


@pytest.fixture(scope="module")
def model() -> Any:
    return build(qwen3_config())


@pytest.fixture(scope="module")
def model_dir(model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save(model, tmp_path_factory.mktemp("calib") / "bf16")
    _tokenizer().save_pretrained(path)
    return path


def test_amax_and_scale_equal_the_hand_computation_bit_for_bit(model: Any) -> None:
    batches = _batches()
    cal = collect_input_amax(model, batches)
    seen = _captured_inputs(model, batches)
    assert set(cal.amax) == set(seen) - {"lm_head"}
    assert len(cal.amax) == 21
    assert cal.batches == 3
    assert cal.unused == []
    for name, a in cal.amax.items():
        want = _by_hand(seen[name])
        assert _f32_bits(a) == _f32_bits(want), name
        scale = input_scale(a)
        assert scale.dtype == torch.float32
        assert scale.shape == ()
        # fp32 division == float64 division rounded once to fp32 (correct rounding).
        assert _f32_bits(scale) == _f32_bits(np.float32(float(want) / 2688.0)), name
        assert _f32_bits(input_scale(a, "fp8_e4m3")) == _f32_bits(np.float32(float(want) / 448.0))
    # The model was not changed: no hook left behind.
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_scales_are_the_quantizers_own_tensor_scales(model: Any) -> None:
    """input_scale is what quantize() would pick as the tensor-level scale of the largest
    activation: the NVFP4 global scale and the FP8 per-tensor scale, bit for bit."""
    batches = _batches(2)
    seen = _captured_inputs(model, batches)
    cal = collect_input_amax(model, batches)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj"):
        peak = max(seen[name], key=lambda x: float(x.float().abs().max()))
        g = mq.quantize(peak, "nvfp4").global_scale
        assert g is not None
        assert same_bits(input_scale(cal.amax[name]), g)
        fp8 = mq.quantize(peak, "fp8_e4m3").scales.reshape(())
        assert same_bits(input_scale(cal.amax[name], "fp8_e4m3"), fp8)


def test_export_writes_and_import_keeps_the_calibrated_scales(
    model: Any, model_dir: Path, tmp_path: Path
) -> None:
    cal = collect_input_amax(model, _batches())
    out = tmp_path / "nv"
    plan = export_checkpoint(model_dir, out, "nvfp4", input_amax=cal.amax)
    raw = read_all(out)
    scales = {k[: -len(".input_scale")]: v for k, v in raw.items() if k.endswith(".input_scale")}
    assert set(scales) == set(cal.amax) == set(plan.input_scales)
    for m, t in scales.items():
        # q/k/v and gate/up share their input, so a group's max is each member's own amax.
        assert same_bits(t, input_scale(cal.amax[m])), m
        assert _f32_bits(plan.input_scales[m]) == _f32_bits(t)
    back = load_quantized(out, dequantize=False)
    for m, t in scales.items():
        assert same_bits(back[m + ".input_scale"], t)  # type: ignore[arg-type]
    # The JSON file of the CLI carries the exact values.
    saved = cal.save(tmp_path / "amax.json")
    assert json.loads(saved.read_text()) == cal.amax


def _experts_by_hand(model: Any, batches: list[Any]) -> dict[str, np.float32]:
    """Per-expert input amax of fused experts, from the experts' own inputs and routing."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):

            def pre(m: Any, args: Any, name: str = name) -> None:
                seen.append((name, args[0].detach().clone(), args[1].detach().clone()))

            handles.append(mod.register_forward_pre_hook(pre))
    model.config._experts_implementation = "eager"  # the path calibration observes
    with torch.no_grad():
        for b in batches:
            model(**b)
    model.config._experts_implementation = "grouped_mm"
    for h in handles:
        h.remove()
    xs: dict[str, list[torch.Tensor]] = {}
    for name, hidden, top_k in seen:
        mod = model.get_submodule(name)
        for e in range(mod.gate_up_proj.shape[0]):
            _, tok = torch.where((top_k == e).T)  # the eager loop's token order
            if tok.numel() == 0:
                continue
            x = hidden[tok]
            with torch.no_grad():
                gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
            for leaf, inp in (("gate", x), ("up", x), ("down", mod.act_fn(gate) * up)):
                xs.setdefault(f"{name}.{e}.{leaf}_proj", []).append(inp)
    return {n: _by_hand(v) for n, v in xs.items()}


def test_fused_moe_experts_per_expert_bit_for_bit(tmp_path: Path) -> None:
    model = build(qwen3_moe_config())
    assert model.config._experts_implementation == "grouped_mm"
    batches = _batches()
    cal = collect_input_amax(model, batches)
    assert model.config._experts_implementation == "grouped_mm"  # restored
    want = _experts_by_hand(model, batches)
    experts = {n: a for n, a in cal.amax.items() if ".experts." in n}
    assert set(experts) == set(want)
    assert len(want) + len(cal.unused) == 2 * 4 * 3  # 2 layers x 4 experts x gate/up/down
    for n, a in experts.items():
        assert _f32_bits(a) == _f32_bits(want[n]), n
    # Exported under the per-expert names engines load, each with its own input_scale.
    out = tmp_path / "nv"
    plan = export_checkpoint(save(model, tmp_path / "bf16"), out, "nvfp4", input_amax=cal.amax)
    raw = read_all(out)
    for n, a in experts.items():
        assert same_bits(raw[n + ".input_scale"], input_scale(a)), n
    assert all(plan.input_scales[n] != 1.0 for n in experts)


def test_modules_filter_and_unused_modules() -> None:
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner["a"](x) + self.inner["a"](2 * x)  # called twice, b never

    x = torch.tensor([[1.0, -3.0, 0.5, 2.0]])
    cal = collect_input_amax(Net(), [x], skip=())
    assert cal.amax == {"inner.a": 6.0}
    assert cal.unused == ["inner.b"]
    cal = collect_input_amax(Net(), [(x,)], modules=["inner.b"])
    assert cal.amax == {}
    assert cal.unused == ["inner.b"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activation_names_module_and_batch(bad: float) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    good = torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"input of 0 holds NaN or Inf in calibration batch 1"):
        collect_input_amax(net, [good, torch.tensor([[1.0, bad, 0.0, 0.0]])])
    assert all(not m._forward_pre_hooks for m in net.modules())


def test_errors() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(
        ValueError,
        match=r"no torch\.nn\.Linear module \(or fused MoE expert\) of the model is selected",
    ):
        collect_input_amax(net, [torch.ones(1, 4)], modules=["*.experts.*"])
    with pytest.raises(ValueError, match=r"no torch\.nn\.Linear module"):
        collect_input_amax(torch.nn.ReLU(), [torch.ones(1, 4)])
    with pytest.raises(ValueError, match="empty calibration set"):
        collect_input_amax(net, [])
    with pytest.raises(ValueError, match="bad regular expression"):
        collect_input_amax(net, [torch.ones(1, 4)], modules=["re:("])
    with pytest.raises(ValueError, match="skip takes a list of patterns"):
        collect_input_amax(net, [torch.ones(1, 4)], skip="lm_head")
    for amax in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            input_scale(amax)
    with pytest.raises(ValueError, match="no static input scale for format 'mxfp4'"):
        input_scale(1.0, "mxfp4")
    assert Calibration().amax == {}


def test_read_prompts(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    lines = [
        json.dumps("plain"),
        "",
        json.dumps({"text": "a text"}),
        json.dumps({"prompt": "a prompt", "id": 3}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    ]
    f.write_text("\n".join(lines) + "\n")
    got = read_prompts(f)
    assert got == ["plain", "a text", "a prompt", [{"role": "user", "content": "hi"}]]
    assert read_prompts(f, limit=2) == ["plain", "a text"]
    (tmp_path / "bad.jsonl").write_text('"ok"\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON string or an object"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text("{nope\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not valid JSON"):
        read_prompts(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty calibration set"):
        read_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="must be >= 1"):
        read_prompts(f, limit=0)


def test_calibrate_checkpoint_runs_each_prompt_alone(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    # Loaded, not the in-memory fixture: .to(bfloat16) also rounds the rotary inv_freq
    # buffer, which from_pretrained recomputes in fp32.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.bfloat16  # the checkpoint's own dtype
    prompts: list[Any] = ["Hello world.", [{"role": "user", "content": "What is 2 and 3?"}]]
    cal = calibrate_checkpoint(model_dir, prompts, max_length=8)
    tok = _tokenizer()
    ids = [tok("Hello world.")["input_ids"][:8]]
    text = tok.apply_chat_template(prompts[1], tokenize=False)
    ids.append(tok(text, add_special_tokens=False)["input_ids"][:8])
    want = collect_input_amax(model, [{"input_ids": torch.tensor([i])} for i in ids])
    assert cal.batches == 2
    assert cal.amax == want.amax
    with pytest.raises(ValueError, match="empty calibration set"):
        calibrate_checkpoint(model_dir, [])
    with pytest.raises(ValueError, match="prompt 0 has no tokens"):
        calibrate_checkpoint(model_dir, [""])


def test_cli_calibrates_and_exports(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i}: abc"}) + "\n" for i in range(5)))
    out, amax_file = tmp_path / "nv", tmp_path / "amax.json"
    argv = [str(model_dir), str(out), "-f", "nvfp4", "--no-progress", "--calib-data", str(data)]
    assert main([*argv, "--calib-samples", "3", "--calib-out", str(amax_file)]) == 0
    text = capsys.readouterr().out
    assert "calibrated 21 Linear modules on 3 prompts" in text
    assert "input_scale: calibrated for 21 modules, 1.0 for 0" in text
    want = calibrate_checkpoint(model_dir, read_prompts(data, limit=3))
    assert json.loads(amax_file.read_text()) == want.amax
    raw = read_all(out)
    for m, a in want.amax.items():
        assert same_bits(raw[m + ".input_scale"], input_scale(a)), m
    # The saved file feeds --input-amax: the same checkpoint again, bit for bit.
    again = tmp_path / "again"
    argv2 = [str(model_dir), str(again), "-f", "nvfp4", "--no-progress"]
    assert main([*argv2, "--input-amax", str(amax_file)]) == 0
    for k, v in read_all(again).items():
        assert same_bits(v, raw[k]), k


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-f", "nvfp4", "--input-amax", "{a}", "--calib-data", "{d}"], "not both"),
        (["-f", "fp8_block128", "--calib-data", "{d}"], "calibrates the nvfp4 input_scale"),
        (["-f", "nvfp4", "--calib-data", "{d}", "--calib-samples", "0"], "must be >= 1"),
    ],
)
def test_cli_errors(
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('"x"\n')
    (tmp_path / "a.json").write_text("{}")
    argv = [str(model_dir), str(tmp_path / "o")]
    argv += [e.format(a=tmp_path / "a.json", d=data) for e in extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
