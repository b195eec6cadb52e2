"""Low-precision serving (EngineConfig.weight_format): served bits, logprobs, updates, flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles_rollout import EngineConfig, SamplingParams
from miles_rollout.quantized import QuantizedWeights, served_digests
from miles_transfer import tensor_digest

mq = pytest.importorskip("miles_quant")

FORMATS = {  # recipe name -> miles-quant format
    "fp8_block128": "fp8_block128",
    "mxfp8": "mxfp8_e4m3",
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
    "int4_g32": "int4_g32",
}
PROMPTS = [[5, 17, 33, 40], [9, 9, 64, 70, 71, 80], [3, 44]]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _q(engine: Any) -> QuantizedWeights:
    quant = engine.quantized_weights
    assert quant is not None
    return quant


def _reference(w: torch.Tensor, fmt: str) -> Any:
    return mq.quantize(w, fmt, stacked=w.dim() == 3, backend="torch")


def _assert_served_is_reference(engine: Any, dtype: torch.dtype) -> None:
    quant = _q(engine)
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    for name in quant.names:
        ref = _reference(params[name].detach(), quant.format)
        got = quant.quantized(name)
        assert _same_bits(got.data, ref.data), name
        assert _same_bits(got.scales, ref.scales), name
        if ref.global_scale is not None:
            assert _same_bits(got.global_scale, ref.global_scale), name
        deq = mq.dequantize(ref, dtype, backend="torch")
        assert _same_bits(quant.dequantized(name), deq), name


def _teacher(model_dir: Path, engine: Any, dtype: torch.dtype) -> Any:
    """A transformers model whose quantized weights are miles-quant's dequantized reference."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": "eager"} if dtype == torch.bfloat16 else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).eval()
    quant = _q(engine)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in quant.names:
            w = params[name]
            w.copy_(mq.dequantize(_reference(w.detach(), quant.format), dtype, backend="torch"))
    return model


def _max_gap(engine: Any, teacher: Any) -> float:
    futs = [
        engine.submit(p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i))
        for i, p in enumerate(PROMPTS)
    ]
    gap = 0.0
    for p, fut in zip(PROMPTS, futs):
        out = fut.result()
        ids = torch.tensor([p + out.output_ids])
        with torch.inference_mode():
            logp = torch.log_softmax(teacher(ids).logits[0].float(), dim=-1)
        pos = torch.arange(len(p) - 1, len(p) + len(out.output_ids) - 1)
        ref = logp[pos, torch.tensor(out.output_ids)]
        gap = max(gap, float((ref - torch.tensor(out.output_logprobs)).abs().max()))
    return gap


@pytest.mark.parametrize("weight_format", list(FORMATS))
def test_engine_serves_miles_quant_bits_and_logprobs_match_a_dequantized_forward(
    model_dir: Path, weight_format: str
) -> None:
    cfg = EngineConfig(model_path=str(model_dir), weight_format=weight_format, seed=0)
    with cfg.build() as engine:
        quant = _q(engine)
        assert quant is not None
        assert quant.format == FORMATS[weight_format]
        # Everything but embeddings / lm_head / norms: 7 matrices per layer, 2 layers.
        assert len(quant.names) == 14
        assert "model.embed_tokens.weight" in quant.selection.kept
        _assert_served_is_reference(engine, torch.float32)
        assert _max_gap(engine, _teacher(model_dir, engine, torch.float32)) < 1e-5
        assert engine.server_info()["weight_format"] == FORMATS[weight_format]


def test_bfloat16_engine_with_nvfp4_matches_a_bf16_dequantized_teacher(model_dir: Path) -> None:
    """PyTorch kernels: measured 0 difference. The native attention's 1-ulp differences (see
    the README) reach 0.04 on one token of this model under nvfp4 weights."""
    cfg = EngineConfig(
        model_path=str(model_dir), dtype="bfloat16", weight_format="nvfp4", kernel_backend="torch"
    )
    with cfg.build() as engine:
        _assert_served_is_reference(engine, torch.bfloat16)
        assert _max_gap(engine, _teacher(model_dir, engine, torch.bfloat16)) < 2e-2


def test_weight_updates_requantize_and_served_digests_match_the_trainer_side(
    model_dir: Path, model_dir_v2: Path
) -> None:
    from safetensors.torch import load_file

    cfg = EngineConfig(model_path=str(model_dir), weight_format="mxfp4", seed=0)
    new = load_file(str(next(model_dir_v2.glob("*.safetensors"))))
    with cfg.build() as engine:
        prompt = [5, 6, 7, 8, 9, 10]
        first = engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))
        again = engine.generate([*prompt, 11], SamplingParams(max_new_tokens=4, temperature=0))
        assert again.cached_tokens > 0  # the prefix cache works under a quantized format
        before = engine.served_weights_checksum()
        # Two buckets, as a bucketed push sends them; only what they touch is re-quantized.
        items = sorted(new.items())
        engine.update_weights_from_tensor(items[:5], flush_cache=False)
        engine.update_weights_from_tensor(items[5:], weight_version="1")
        _assert_served_is_reference(engine, torch.float32)
        served = engine.served_weights_checksum()
        assert served != before
        expected = served_digests(new.items(), _q(engine).selection, torch.float32)
        assert {n: served[n] for n in expected if n in served} == {
            n: expected[n] for n in expected if n in served
        }
        # The transfer's own verification still compares the received tensors.
        assert engine.weights_checksum(["model.layers.0.mlp.down_proj.weight"]) == {
            "model.layers.0.mlp.down_proj.weight": tensor_digest(
                new["model.layers.0.mlp.down_proj.weight"]
            )
        }
        out = engine.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))
        assert out.cached_tokens == 0  # the update dropped the cache
        assert out.weight_version == "1"
        assert first.weight_version == "0"


def test_moe_experts_quantized_stacked_and_updated_through_per_expert_names(
    tmp_path: Path,
) -> None:
    from tiny_moe import build_qwen3_moe

    path = build_qwen3_moe(tmp_path / "moe")
    cfg = EngineConfig(
        model_path=str(path), weight_format="int4_g32", quantize_only=["*.experts.*"]
    )
    with cfg.build() as engine:
        quant = _q(engine)
        assert sorted(quant.names) == sorted(
            f"model.layers.{i}.mlp.experts.{p}"
            for i in (0, 2)
            for p in ("gate_up_proj", "down_proj")
        )
        _assert_served_is_reference(engine, torch.float32)
        name = "model.layers.2.mlp.experts.3.down_proj.weight"
        engine.update_weights_from_tensor([(name, torch.randn(64, 32))])
        _assert_served_is_reference(engine, torch.float32)  # the fused tensor re-quantized
        out = engine.generate(
            [4, 5, 6], SamplingParams(max_new_tokens=3), return_routed_experts=True
        )
        assert out.routed_experts is not None


def test_layer_flags_keep_chosen_weights_unquantized(model_dir: Path) -> None:
    cfg = EngineConfig(
        model_path=str(model_dir),
        weight_format="nvfp4",
        keep_bf16=["*.self_attn.o_proj"],
        keep_first_layers=1,
    )
    with cfg.build() as engine:
        quant = _q(engine)
        kept = quant.selection.kept
        assert kept["model.layers.0.mlp.down_proj.weight"] == "first layers"
        assert kept["model.layers.1.self_attn.o_proj.weight"] == "keep_bf16"
        assert sorted(quant.names) == sorted(
            f"model.layers.1.{m}.weight"
            for m in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        )
        # A kept weight is served as received.
        digest = engine.served_weights_checksum(["model.layers.0.mlp.down_proj.weight"])
        assert digest == engine.weights_checksum(["model.layers.0.mlp.down_proj.weight"])
    last = EngineConfig(model_path=str(model_dir), weight_format="fp8_block128", keep_last_layers=1)
    with last.build() as engine:
        assert all(n.startswith("model.layers.0.") for n in _q(engine).names)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight_format": "int8"}, "cannot be served by the embedded engine"),
        ({"weight_format": "bf16"}, "engine.dtype: bfloat16"),
        ({"keep_bf16": ["*.q_proj"]}, "nothing is quantized"),
        ({"weight_format": "nvfp4", "keep_bf16": "*.q_proj"}, "list of patterns"),
    ],
)
def test_config_errors_name_the_fix(model_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path=str(model_dir), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight_format": "nvfp4", "keep_bf16": ["*.no_such_proj"]}, "matches no parameter"),
        ({"weight_format": "nvfp4", "quantize_only": ["re:experts"]}, "matches no parameter"),
        ({"weight_format": "nvfp4", "keep_last_layers": 3}, "has 2 layers"),
        ({"weight_format": "int4_g128"}, r"q_proj.weight \(shape \(64, 64\)\).*keep_bf16"),
        (
            {"weight_format": "mxfp4", "keep_first_layers": 1, "keep_last_layers": 1},
            "leaves no weight to quantize",
        ),
    ],
)
def test_start_errors_for_what_the_engine_cannot_serve(
    model_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path=str(model_dir), **kwargs).build()


def test_bf16_and_fp32_formats_serve_unquantized(model_dir: Path) -> None:
    with EngineConfig(model_path=str(model_dir), weight_format="fp32").build() as engine:
        assert engine.quantized_weights is None
        assert engine.served_weights_checksum() == engine.weights_checksum()


def test_sglang_backend_sets_the_quantization_flags_of_each_format(tmp_path: Path) -> None:
    from miles_rollout.fleet import FleetConfig
    from miles_rollout.fleet.engines import engine_command
    from miles_rollout.fleet.sglang import quantization_args, sglang_argv

    expected = {
        "fp8_block128": "fp8",
        "mxfp8": "mxfp8",
        "nvfp4": "modelopt_fp4",
        "mxfp4": "mxfp4",
        "int4_g32": "compressed-tensors",
        "int4_g128": "compressed-tensors",
    }
    for fmt, method in expected.items():
        argv = sglang_argv(
            index=0,
            model_path="/m",
            host="127.0.0.1",
            port=1,
            dp_size=1,
            sglang_args={"tp_size": 2},
            weight_format=fmt,
        )
        flags = argv[argv.index("--port") + 2 :]
        assert flags == ["--dtype", "bfloat16", "--quantization", method, "--tp-size", "2"], fmt
    assert quantization_args("bf16") == {"dtype": "bfloat16"}
    assert quantization_args(None) == {}
    with pytest.raises(ValueError, match="no SGLang quantization"):
        quantization_args("int8")
    with pytest.raises(ValueError, match=r"quantization='fp8'.*drop one"):
        sglang_argv(
            index=0,
            model_path="/m",
            host="h",
            port=1,
            dp_size=1,
            sglang_args={"quantization": "awq"},
            weight_format="fp8_block128",
        )
    # The fleet passes its weight_format to either backend.
    cfg = FleetConfig(model_path=str(tmp_path), backend="sglang", weight_format="nvfp4")
    assert "modelopt_fp4" in engine_command(cfg, 0).argv
    embedded = FleetConfig(model_path=str(tmp_path), weight_format="nvfp4")
    argv = engine_command(embedded, 0).argv
    assert argv[argv.index("--weight-format") + 1] == "nvfp4"


def test_serve_command_line_takes_the_weight_format(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles_rollout.cli import main

    argv = ["serve", "--model-path", str(model_dir), "--weight-format", "nvfp4"]
    assert main([*argv, "--keep-bf16", "*.nothing_here"]) == 2
    assert "keep_bf16 pattern '*.nothing_here' matches no parameter" in capsys.readouterr().err


def test_http_weights_checksum_reports_what_is_served(model_dir: Path) -> None:
    import json
    import urllib.request

    from miles_rollout import serve

    with EngineConfig(model_path=str(model_dir), weight_format="nvfp4").build() as engine:
        handle = serve(engine)
        try:

            def checksum(body: dict[str, Any]) -> dict[str, str]:
                req = urllib.request.Request(
                    handle.url + "/weights_checksum",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=60) as r:
                    return dict(json.loads(r.read()))

            name = "model.layers.0.mlp.up_proj.weight"
            assert checksum({"names": [name], "served": True}) == (
                engine.served_weights_checksum([name])
            )
            assert checksum({"names": [name]}) == engine.weights_checksum([name])
            assert checksum({"names": [name], "served": True})[name].startswith("nvfp4:")
        finally:
            handle.close()
