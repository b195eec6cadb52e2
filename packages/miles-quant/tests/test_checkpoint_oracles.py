"""Third-party loaders read the exported checkpoints to the same bits as miles_quant.

transformers' own quantized-checkpoint loaders, run with dequantization on CPU, stand in for an
engine here: compressed-tensors `pack-quantized` (the compressed-tensors package),
DeepSeek FP8 (`FineGrainedFP8Config`, needs accelerate) and gpt-oss MXFP4 (`Mxfp4Config`, a
tiny GptOss model). Each must produce, bit for bit, the tensors `load_quantized` dequantizes.
ModelOpt NVFP4 has no CPU loader here (transformers refuses pre-quantized NVFP4), so it is
checked by the independent decoder in test_checkpoint.py only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoint_testlib import build, qwen3_config, qwen3_moe_config, save
from _quant_testlib import same_bits

from miles_quant.checkpoint import export_checkpoint, load_quantized, plan_export


def _load(path: Path, quantization_config: Any) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=quantization_config
    )
    return model.state_dict()


def _assert_loads_like_ours(path: Path, quantization_config: Any) -> None:
    theirs = _load(path, quantization_config)
    ours = load_quantized(path, dtype=torch.bfloat16)
    plan_names = {k for k, v in load_quantized(path, dequantize=False).items() if k in ours}
    compared = 0
    for name, t in ours.items():
        if name in theirs:
            assert isinstance(t, torch.Tensor)
            assert same_bits(theirs[name], t), name
            compared += 1
    assert compared >= len(plan_names) // 2  # MoE per-expert names are fused by transformers


def _fused_expert_check(path: Path, quantization_config: Any) -> None:
    """Qwen3-MoE: transformers fuses per-expert tensors; compare the fused parameters."""
    theirs = _load(path, quantization_config)
    ours = load_quantized(path, dtype=torch.bfloat16)
    inter = qwen3_moe_config().moe_intermediate_size
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up, down = theirs[f"{p}.gate_up_proj"], theirs[f"{p}.down_proj"]
        for e in range(4):
            assert same_bits(gate_up[e, :inter], ours[f"{p}.{e}.gate_proj.weight"])  # type: ignore[arg-type]
            assert same_bits(gate_up[e, inter:], ours[f"{p}.{e}.up_proj.weight"])  # type: ignore[arg-type]
            assert same_bits(down[e], ours[f"{p}.{e}.down_proj.weight"])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(qwen3_config()), tmp_path_factory.mktemp("oracle-dense") / "src")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(qwen3_moe_config()), tmp_path_factory.mktemp("oracle-moe") / "src")


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_g128"])
def test_compressed_tensors_reads_int4(fmt: str, dense: Path, moe: Path, tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors", reason="oracle: pip install compressed-tensors")
    from transformers import CompressedTensorsConfig

    export_checkpoint(dense, tmp_path / "dense", fmt, keep_first_layers=1)
    _assert_loads_like_ours(tmp_path / "dense", CompressedTensorsConfig(dequantize=True))
    export_checkpoint(moe, tmp_path / "moe", fmt, only=["*.experts.*"])
    _fused_expert_check(tmp_path / "moe", CompressedTensorsConfig(dequantize=True))


def test_transformers_reads_deepseek_fp8(dense: Path, moe: Path, tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="oracle: transformers' FP8 loader needs accelerate")
    from transformers import FineGrainedFP8Config

    export_checkpoint(dense, tmp_path / "dense", "fp8_block128", keep_last_layers=1)
    _assert_loads_like_ours(tmp_path / "dense", FineGrainedFP8Config(dequantize=True))
    export_checkpoint(moe, tmp_path / "moe", "fp8_block128")
    _fused_expert_check(tmp_path / "moe", FineGrainedFP8Config(dequantize=True))


def test_transformers_reads_gpt_oss_mxfp4(tmp_path: Path) -> None:
    from transformers import GptOssConfig, Mxfp4Config

    config = GptOssConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=64,  # down_proj [E, 64, 128]: not square, so orientation matters
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        layer_types=["full_attention", "full_attention"],
    )
    src = save(build(config), tmp_path / "src")
    plan = plan_export(src, "mxfp4", only=["*.experts.*"])
    assert plan.quantized == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
    ]
    out = tmp_path / "mxfp4"
    export_checkpoint(src, out, "mxfp4", only=["*.experts.*"])
    theirs = _load(out, Mxfp4Config(dequantize=True))
    ours = load_quantized(out, dtype=torch.bfloat16)
    for name in plan.quantized:  # gpt-oss keeps experts as [E, in, out]; blocks go along "in"
        assert same_bits(theirs[name], ours[name]), name  # type: ignore[arg-type]
    raw = load_quantized(out, dequantize=False)
    assert raw["model.layers.0.mlp.experts.down_proj_bias"].dtype == torch.bfloat16  # type: ignore[union-attr]
