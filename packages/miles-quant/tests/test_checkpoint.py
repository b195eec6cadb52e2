"""miles_quant.checkpoint: export in engine layouts, bit for bit, and read back.

Each layout is also decoded here independently of the package (raw safetensors, shifts and
tables written out), so a convention slip (nibble order, offset, scale meaning) would show.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _checkpoint_testlib import build, qwen3_config, qwen3_moe_config, read_all, save
from _quant_testlib import same_bits

import miles_quant as mq
from miles_quant.checkpoint import (
    LAYOUTS,
    dequantize_checkpoint,
    export_checkpoint,
    iter_quantized,
    load_quantized,
    plan_export,
)

FORMATS = sorted(LAYOUTS)
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(qwen3_config()), tmp_path_factory.mktemp("qwen3") / "bf16")


@pytest.fixture(scope="module")
def exported(src: Path) -> dict[str, Path]:
    out = {}
    for fmt in FORMATS:
        export_checkpoint(src, src.parent / fmt, fmt, keep_last_layers=1)
        out[fmt] = src.parent / fmt
    return out


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1_VALUES)[(codes & 7).long()]
    return torch.where(codes >= 8, -mag, mag)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> [..., 2B] codes, element 0 from the low nibble."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _independent_decode(fmt: str, raw: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    """fp32 values of parameter ``p`` from the raw stored tensors (the layout's definition)."""
    if fmt == "fp8_block128":
        s = raw[p + "_scale_inv"]
        n, k = raw[p].shape
        s_el = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return raw[p].float() * s_el
    if fmt == "nvfp4":
        s = raw[p + "_scale_2"] * raw[p + "_scale"].float()
        return _e2m1(_nibbles(raw[p])) * s.repeat_interleave(16, -1)
    if fmt == "mxfp4":
        blocks, scales = raw[p + "_blocks"], raw[p + "_scales"]
        v = _e2m1(_nibbles(blocks))  # [N, G, 32]
        s = torch.exp2(scales.float() - 127.0).unsqueeze(-1)
        return (v * s).flatten(-2)
    w = raw[p + "_packed"]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((w.unsqueeze(-1) >> shifts) & 0xF).flatten(-2) - 8  # bits 0-3 = element 0
    assert raw[p + "_shape"].tolist() == list(codes.shape)
    group = 32 if fmt == "int4_g32" else 128
    return codes.float() * raw[p + "_scale"].float().repeat_interleave(group, -1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_has_the_bits_of_quantize(fmt: str, src: Path, exported: dict[str, Path]) -> None:
    source = read_all(src)
    plan = plan_export(src, fmt, keep_last_layers=1)
    got = load_quantized(exported[fmt], dequantize=False)
    fused = {m: g for g in plan.fused for m in g}
    assert plan.quantized, "nothing quantized"
    for name in plan.quantized:
        members = fused.get(name, [name])
        x = torch.cat([source[m] for m in members], dim=0)
        want = mq.quantize(x, fmt)
        start = sum(source[m].shape[0] for m in members[: members.index(name)])
        rows = slice(start, start + source[name].shape[0])
        q = got[name]
        assert isinstance(q, mq.QuantizedTensor)
        assert (q.format, q.shape, q.dtype) == (fmt, tuple(source[name].shape), torch.bfloat16)
        assert same_bits(q.data, want.data[rows]), name
        assert same_bits(q.scales, want.scales[rows]), name
        if fmt == "nvfp4":
            assert want.global_scale is not None
            assert q.global_scale is not None
            assert same_bits(q.global_scale, want.global_scale), name
    for name, why in plan.kept.items():
        t = got[name]
        assert isinstance(t, torch.Tensor)
        assert same_bits(t, source[name]), f"{name} ({why}) changed"


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_decodes_independently(fmt: str, exported: dict[str, Path]) -> None:
    raw = read_all(exported[fmt])
    got = load_quantized(exported[fmt], dequantize=False)
    n = 0
    for name, q in got.items():
        if not isinstance(q, mq.QuantizedTensor):
            continue
        n += 1
        assert torch.equal(_independent_decode(fmt, raw, name), mq.dequantize(q, torch.float32))
    assert n == 14  # 7 Linear weights in each of layers 0 and 1 (layer 2 kept)


def test_layout_names_dtypes_shapes(exported: dict[str, Path]) -> None:
    p = "model.layers.0.mlp.down_proj.weight"  # [128, 256]
    m = "model.layers.0.mlp.down_proj."
    fp8 = read_all(exported["fp8_block128"])
    assert (fp8[p].dtype, fp8[p].shape) == (torch.float8_e4m3fn, (128, 256))
    assert (fp8[m + "weight_scale_inv"].dtype, fp8[m + "weight_scale_inv"].shape) == (
        torch.float32,
        (1, 2),
    )
    nv = read_all(exported["nvfp4"])
    assert (nv[p].dtype, nv[p].shape) == (torch.uint8, (128, 128))
    assert (nv[m + "weight_scale"].dtype, nv[m + "weight_scale"].shape) == (
        torch.float8_e4m3fn,
        (128, 16),
    )
    assert nv[m + "weight_scale_2"].shape == ()
    assert nv[m + "input_scale"].shape == ()
    mx = read_all(exported["mxfp4"])
    assert mx[m + "weight_blocks"].shape == (128, 8, 16)
    assert (mx[m + "weight_scales"].dtype, mx[m + "weight_scales"].shape) == (torch.uint8, (128, 8))
    ct = read_all(exported["int4_g128"])
    assert (ct[m + "weight_packed"].dtype, ct[m + "weight_packed"].shape) == (
        torch.int32,
        (128, 32),
    )
    assert (ct[m + "weight_scale"].dtype, ct[m + "weight_scale"].shape) == (
        torch.bfloat16,
        (128, 2),
    )
    assert ct[m + "weight_shape"].tolist() == [128, 256]
    assert p not in ct


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_and_side_files(fmt: str, src: Path, exported: dict[str, Path]) -> None:
    out = exported[fmt]
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    kept = {"lm_head", "model.embed_tokens"} | {
        f"model.layers.2.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    if fmt == "fp8_block128":
        assert (q["quant_method"], q["fmt"], q["weight_block_size"]) == ("fp8", "e4m3", [128, 128])
        assert set(q["ignored_layers"]) == kept == set(q["modules_to_not_convert"])
    elif fmt == "nvfp4":
        assert (q["quant_method"], q["quant_algo"], q["group_size"]) == ("modelopt", "NVFP4", 16)
        assert set(q["ignore"]) == kept
        hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert (hf["quant_algo"], set(hf["exclude_modules"])) == ("NVFP4", kept)
    elif fmt == "mxfp4":
        assert q["quant_method"] == "mxfp4"
        assert set(q["modules_to_not_convert"]) == kept
    else:
        w = q["config_groups"]["group_0"]["weights"]
        assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
        assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (
            4,
            int(fmt[-3:].lstrip("_g")),
            True,
            "group",
        )
        assert set(q["ignore"]) == kept
    assert cfg["num_hidden_layers"] == 3
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not list(out.parent.glob(".*tmp-*")), "temp dir left behind"


def test_nvfp4_fuses_qkv_and_gate_up(src: Path) -> None:
    plan = plan_export(src, "nvfp4")
    groups = {tuple(n.rsplit(".", 2)[-2] for n in g) for g in plan.fused}
    assert groups == {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}
    assert len(plan.fused) == 6  # two groups in each of 3 layers
    got = load_quantized(src.parent / "nvfp4", dequantize=False)  # layers 0-1 exported
    g = [got[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"]
    assert all(same_bits(x.global_scale, g[0].global_scale) for x in g)  # type: ignore[union-attr, arg-type]


def test_iter_quantized_dequantized_state(exported: dict[str, Path], src: Path) -> None:
    state = dict(iter_quantized(exported["nvfp4"], dequantize_to=torch.bfloat16))
    assert set(state) == set(read_all(src))  # HF names, no input_scale
    raw = load_quantized(exported["nvfp4"], dequantize=False)
    p = "model.layers.1.self_attn.o_proj.weight"
    q = raw[p]
    assert isinstance(q, mq.QuantizedTensor)
    assert same_bits(state[p], mq.dequantize(q, torch.bfloat16))
    assert "model.layers.1.self_attn.o_proj.input_scale" in raw


def test_sharded_output_and_input(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    export_checkpoint(src, out, "int4_g32", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3
    assert all((out / f).is_file() for f in files)
    # A sharded source converts too, to the same tensors.
    again = tmp_path / "again"
    dequantize_checkpoint(out, again, max_shard_bytes=100_000)
    twice = tmp_path / "twice"
    export_checkpoint(again, twice, "int4_g32")
    a, b = load_quantized(out, dequantize=False), load_quantized(twice, dequantize=False)
    assert list(a) == list(b)
    for name, q in a.items():
        r = b[name]
        if isinstance(q, mq.QuantizedTensor):
            assert isinstance(r, mq.QuantizedTensor)
            assert same_bits(q.data, r.data)
            assert same_bits(q.scales, r.scales)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_g128", "fp8_block128"])
def test_moe_export_has_the_bits_of_quantize(fmt: str, tmp_path: Path) -> None:
    src = save(build(qwen3_moe_config()), tmp_path / "moe")
    out = tmp_path / fmt
    plan = export_checkpoint(src, out, fmt)
    source = read_all(src)
    got = load_quantized(out, dequantize=False)
    expert = "model.layers.1.mlp.experts.3"
    gate, up = f"{expert}.gate_proj.weight", f"{expert}.up_proj.weight"
    assert gate in plan.quantized
    assert up in plan.quantized
    if fmt == "nvfp4":  # gate/up of one expert share a global scale
        assert [gate, up] in plan.fused
        want = mq.quantize(torch.cat([source[gate], source[up]]), fmt)
        rows = source[gate].shape[0]
        q = got[up]
        assert isinstance(q, mq.QuantizedTensor)
        assert same_bits(q.data, want.data[rows:])
        assert same_bits(q.scales, want.scales[rows:])
        assert want.global_scale is not None
        assert q.global_scale is not None
        assert same_bits(q.global_scale, want.global_scale)
    in_groups = {m for g in plan.fused for m in g}
    for name in plan.quantized:
        if name in in_groups:
            continue
        q = got[name]
        assert isinstance(q, mq.QuantizedTensor)
        want = mq.quantize(source[name], fmt)
        assert same_bits(q.data, want.data), name
        assert same_bits(q.scales, want.scales), name
    assert plan.kept["model.layers.0.mlp.gate.weight"] == "always kept"


def test_streams_tensor_by_tensor(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays at one shard plus the tensor in hand: every source tensor is read once and
    dropped (no list of them is kept), and each shard is flushed once it reaches the limit."""
    import weakref

    from miles_quant import _checkpoint_io

    alive: list[weakref.ref[torch.Tensor]] = []
    peak = 0
    shards: list[tuple[int, int]] = []  # (bytes, tensors) per flushed shard
    get, flush = _checkpoint_io.TensorReader.get, _checkpoint_io.ShardWriter._flush

    def counting_get(self: _checkpoint_io.TensorReader, name: str) -> torch.Tensor:
        nonlocal peak
        t = get(self, name)
        alive.append(weakref.ref(t))
        peak = max(peak, sum(r() is not None for r in alive))
        return t

    def recording_flush(self: _checkpoint_io.ShardWriter) -> None:
        if self._pending:
            shards.append((self._pending_bytes, len(self._pending)))
        flush(self)

    monkeypatch.setattr(_checkpoint_io.TensorReader, "get", counting_get)
    monkeypatch.setattr(_checkpoint_io.ShardWriter, "_flush", recording_flush)
    limit = 30_000
    export_checkpoint(src, tmp_path / "out", "int4_g32", max_shard_bytes=limit)
    assert len(alive) == len(read_all(src)) == 36  # every tensor read exactly once
    assert peak <= 3, f"{peak} source tensors alive at once"
    assert len(shards) > 5
    assert all(nbytes <= limit or count == 1 for nbytes, count in shards)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_g128", "fp8_block128"])
def test_fused_experts_are_written_per_expert(fmt: str, tmp_path: Path) -> None:
    """A state-dict checkpoint (fused mlp.experts.gate_up_proj / down_proj, as a trainer writes
    it) is exported under the per-expert names engines load."""
    from safetensors.torch import save_file

    model = build(qwen3_moe_config())
    src = save(model, tmp_path / "per-expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(fused / "model.safetensors"))
    (fused / "config.json").write_bytes((src / "config.json").read_bytes())
    plan = export_checkpoint(fused, tmp_path / "q", fmt, keep_bf16=["model.layers.0"])
    assert plan.split["model.layers.1.mlp.experts.gate_up_proj"][:2] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
    ]
    # The same tensors, bit for bit, as exporting the save_pretrained (per-expert) checkpoint.
    export_checkpoint(src, tmp_path / "ref", fmt, keep_bf16=["model.layers.0"])
    got = load_quantized(tmp_path / "q", dequantize=False)
    want = load_quantized(tmp_path / "ref", dequantize=False)
    assert sorted(got) == sorted(want)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in got  # kept, split too
    for name, w in want.items():
        g = got[name]
        if isinstance(w, mq.QuantizedTensor):
            assert isinstance(g, mq.QuantizedTensor)
            assert same_bits(g.data, w.data), name
            assert same_bits(g.scales, w.scales), name
        else:
            assert isinstance(g, torch.Tensor)
            assert same_bits(g, w), name
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    key = {"fp8_block128": "ignored_layers", "nvfp4": "ignore", "int4_g128": "ignore"}[fmt]
    assert "model.layers.0.mlp.experts.2.up_proj" in ignore[key]
