"""Quantized checkpoints of tiny Qwen3 and Qwen3-MoE models load back into transformers.

The chain: save_pretrained (bf16) -> export_checkpoint -> dequantize_checkpoint ->
AutoModelForCausalLM.from_pretrained. The reloaded weights are exactly the dequantized
checkpoint tensors (bit for bit, through transformers' own loading and, for the MoE, its
per-expert -> fused-expert conversion), and the logits stay within what each format's weight
noise allows on a random 2-3 layer model (measured relative errors: fp8 0.11-0.13, 4-bit
0.36-0.45; a layout slip such as a transposed block or a wrong scale gives > 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _checkpoint_testlib import build, logits, qwen3_config, qwen3_moe_config, save
from _quant_testlib import same_bits

from miles_quant.checkpoint import LAYOUTS, dequantize_checkpoint, export_checkpoint, load_quantized

# Relative logit error bounds: about 1.5x the measured error of each format.
BOUND = {"fp8_block128": 0.2, "nvfp4": 0.55, "int4_g32": 0.55, "mxfp4": 0.7, "int4_g128": 0.7}


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = qwen3_config() if request.param == "dense" else qwen3_moe_config()
    return save(build(cfg), tmp_path_factory.mktemp(request.param) / "bf16")


def _reload(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    return model


def _fused_view(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A transformers in-memory parameter rebuilt from per-expert checkpoint tensors."""
    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return state[name]
    prefix, leaf = name.rsplit(".", 1)
    experts = sorted({int(k.split(".")[-3]) for k in state if k.startswith(prefix + ".")})
    if leaf == "down_proj":
        return torch.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    return torch.stack(
        [
            torch.cat(
                [state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"]]
            )
            for e in experts
        ]
    )


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_reloads_exactly_and_logits_stay_close(model_dir: Path, fmt: str, tmp_path: Path) -> None:
    exported = tmp_path / "q"
    export_checkpoint(model_dir, exported, fmt)
    plain = dequantize_checkpoint(exported, tmp_path / "plain")
    state = load_quantized(exported)  # dequantized to the config dtype (bf16)
    reloaded = _reload(plain)
    for name, p in reloaded.state_dict().items():
        want = _fused_view(state, name)  # type: ignore[arg-type]
        assert same_bits(p, want), name
    ref = logits(_reload(model_dir))
    got = logits(reloaded)
    rel = float((got - ref).norm() / ref.norm())
    assert 0.0 < rel < BOUND[fmt], f"{fmt}: relative logit error {rel:.3f}"


def test_kept_layers_reload_bit_identical(model_dir: Path, tmp_path: Path) -> None:
    exported = tmp_path / "q"
    export_checkpoint(model_dir, exported, "nvfp4", keep_first_layers=1, keep_bf16=["*.o_proj"])
    src = _reload(model_dir).state_dict()
    new = _reload(dequantize_checkpoint(exported, tmp_path / "plain")).state_dict()
    for name, p in src.items():
        kept = ".layers.0." in name or ".o_proj." in name or ".layers." not in name
        kept = kept or "norm" in name or name.endswith("mlp.gate.weight")
        assert same_bits(new[name], p) == kept, name
