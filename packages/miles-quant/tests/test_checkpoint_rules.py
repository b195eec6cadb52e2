"""miles_quant.checkpoint: which tensors stay in BF16, and clear errors on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _checkpoint_testlib import build, qwen3_config, qwen3_moe_config, save
from safetensors.torch import save_file

from miles_quant.checkpoint import (
    export_checkpoint,
    load_quantized,
    matches,
    plan_export,
)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(qwen3_config()), tmp_path_factory.mktemp("dense") / "src")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(qwen3_moe_config()), tmp_path_factory.mktemp("moe") / "src")


def test_pattern_syntax() -> None:
    name = "model.layers.3.mlp.experts.7.down_proj.weight"
    assert matches(name, "*.experts.*")
    assert matches(name, "model.layers.3")  # a containing module
    assert matches(name, "*down_proj")
    assert matches(name, r"re:layers\.[0-4]\.")
    assert not matches(name, "down_proj")  # globs match whole names
    assert not matches(name, "re:^down")
    assert matches("lm_head.weight", "lm_head")


def test_default_rules_dense(dense: Path) -> None:
    plan = plan_export(dense, "int4_g128")
    assert len(plan.quantized) == 21  # 7 Linear weights x 3 layers
    assert plan.kept["lm_head.weight"] == "always kept"
    assert plan.kept["model.embed_tokens.weight"] == "always kept"
    assert plan.kept["model.norm.weight"] == "not a weight matrix"
    assert plan.kept["model.layers.0.self_attn.q_norm.weight"] == "not a weight matrix"


def test_first_last_layers_and_patterns(dense: Path) -> None:
    plan = plan_export(dense, "fp8_block128", keep_first_layers=1, keep_last_layers=1)
    assert {n.split(".")[2] for n in plan.quantized} == {"1"}
    assert plan.kept["model.layers.0.mlp.up_proj.weight"] == "first layers"
    assert plan.kept["model.layers.2.mlp.up_proj.weight"] == "last layers"
    plan = plan_export(dense, "fp8_block128", keep_bf16=["*.self_attn.*", r"re:\.down_proj\."])
    assert sorted({n.rsplit(".", 2)[-2] for n in plan.quantized}) == ["gate_proj", "up_proj"]
    plan = plan_export(dense, "fp8_block128", only=["model.layers.1.mlp"])
    assert plan.quantized == [
        f"model.layers.1.mlp.{m}.weight" for m in ("down_proj", "gate_proj", "up_proj")
    ]


def test_moe_router_always_kept_and_experts_only(moe: Path, tmp_path: Path) -> None:
    plan = plan_export(moe, "int4_g128", only=["*.experts.*"])
    assert plan.kept["model.layers.0.mlp.gate.weight"] == "always kept"  # the router
    assert len(plan.quantized) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert all(".mlp.experts." in n for n in plan.quantized)
    out = tmp_path / "w4a16"
    export_checkpoint(moe, out, "int4_g128", only=["*.experts.*"])
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.gate" in ignore
    assert "model.layers.1.self_attn.o_proj" in ignore
    assert not any("experts" in m for m in ignore)


def test_unknown_format(dense: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no checkpoint layout for format 'mxfp8_e4m3'"):
        export_checkpoint(dense, tmp_path / "x", "mxfp8_e4m3")
    with pytest.raises(ValueError, match="no checkpoint layout for format 'int8'"):
        plan_export(dense, "int8")
    assert not (tmp_path / "x").exists()


def _tiny_dir(path: Path, tensors: dict[str, torch.Tensor], **cfg: object) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "x", **cfg}))
    return path


def test_shape_the_layout_cannot_take(tmp_path: Path) -> None:
    src = _tiny_dir(tmp_path / "src", {"a.proj.weight": torch.randn(64, 48)})
    for fmt, multiple in (("mxfp4", 32), ("int4_g128", 128), ("int4_g32", 32)):
        with pytest.raises(ValueError, match=rf"a.proj.weight has shape \[64, 48\].*{multiple}"):
            export_checkpoint(src, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()
        export_checkpoint(src, tmp_path / fmt, fmt, keep_bf16=["a.proj"])  # the way out
    export_checkpoint(src, tmp_path / "nv", "nvfp4")  # 48 % 16 == 0
    export_checkpoint(src, tmp_path / "fp8", "fp8_block128")  # partial 128x128 tiles are fine


def test_missing_inputs(tmp_path: Path, dense: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        export_checkpoint(tmp_path / "nope", tmp_path / "out", "nvfp4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out", "nvfp4")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out", "nvfp4")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_quantized(tmp_path / "nope")
    with pytest.raises(ValueError, match="no quantization_config"):
        load_quantized(dense)
    assert not (tmp_path / "out").exists()


def test_bad_options(dense: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad regular expression"):
        plan_export(dense, "nvfp4", keep_bf16=["re:("])
    with pytest.raises(ValueError, match="only= must name at least one pattern"):
        plan_export(dense, "nvfp4", only=[])
    with pytest.raises(ValueError, match="must be >= 0"):
        plan_export(dense, "nvfp4", keep_first_layers=-1)
    with pytest.raises(ValueError, match="scale_rule applies to mxfp4 only"):
        export_checkpoint(dense, tmp_path / "o", "nvfp4", scale_rule="rceil")
    with pytest.raises(ValueError, match="keep all or none"):
        plan_export(dense, "nvfp4", keep_bf16=["*.k_proj"])
    # A bare string would be iterated character by character ("*" keeps everything).
    with pytest.raises(ValueError, match="keep_bf16 takes a list of patterns"):
        plan_export(dense, "nvfp4", keep_bf16="*.self_attn.*")
    with pytest.raises(ValueError, match="only takes a list of patterns"):
        plan_export(dense, "int4_g32", only="*.mlp.*")
    # only= patterns that match no tensor are a mistake (a typo), not an empty export.
    with pytest.raises(ValueError, match="matches no tensor"):
        export_checkpoint(dense, tmp_path / "o", "nvfp4", only=["*.nothing.*", "lm_hed"])
    assert not (tmp_path / "o").exists()
    # Keys with the parameter's '.weight' suffix match no module: every input_scale would
    # silently be 1.0.
    amax = {"model.layers.1.self_attn.q_proj.weight": 3.0}
    with pytest.raises(ValueError, match="names no quantized module"):
        export_checkpoint(dense, tmp_path / "o", "nvfp4", input_amax=amax)
    assert not (tmp_path / "o").exists()
    plan = export_checkpoint(
        dense, tmp_path / "o", "nvfp4", input_amax={"model.layers.1.self_attn.q_proj": 26.88}
    )
    assert plan.input_scales["model.layers.1.self_attn.k_proj"] == pytest.approx(0.01)
    assert plan.input_scales["model.layers.1.mlp.up_proj"] == 1.0


def test_existing_output_and_already_quantized(dense: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_checkpoint(dense, out, "int4_g32")
    stamp = (out / "config.json").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_checkpoint(dense, out, "fp8_block128")
    assert (out / "config.json").read_bytes() == stamp
    export_checkpoint(dense, out, "fp8_block128", overwrite=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "fp8"
    )
    with pytest.raises(ValueError, match="already quantized"):
        export_checkpoint(out, tmp_path / "twice", "nvfp4")
    with pytest.raises(ValueError, match="must differ from the source"):
        export_checkpoint(dense, dense, "nvfp4", overwrite=True)


def test_failure_leaves_nothing(dense: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_checkpoint(dense, out, "int4_g32")
    before = sorted(p.name for p in out.iterdir())

    def boom(done: int, total: int, name: str) -> None:
        if done > 5:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(dense, out, "nvfp4", overwrite=True, progress=boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(dense, tmp_path / "new", "nvfp4", progress=boom)
    assert sorted(p.name for p in out.iterdir()) == before  # the old checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs, no "new"


def test_broken_layout_is_reported(dense: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_checkpoint(dense, out, "int4_g128")
    from safetensors.torch import load_file

    t = load_file(str(out / "model.safetensors"))
    del t["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj.weight_scale'?, not found"):
        load_quantized(out)


def test_without_safetensors_the_error_names_the_extra(
    dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors raises
    with pytest.raises(ImportError, match=r"pip install 'miles-quant\[checkpoint\]'"):
        export_checkpoint(dense, tmp_path / "out", "nvfp4")
    assert not (tmp_path / "out").exists()
