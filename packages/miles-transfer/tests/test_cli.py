"""The stdlib safetensors reader/writer and the miles-transfer digest/compare commands."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from miles_transfer import tensor_digest
from miles_transfer.checkpoint import iter_safetensors, save_safetensors
from miles_transfer.cli import main


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6, generator=g).to(
            torch.float8_e4m3fn
        ),
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
        "model.norm.weight": torch.tensor([0.0, -0.0, 1.0]),
        "e8m0_scales": torch.tensor([0.5, 2.0, 8.0]).to(torch.float8_e8m0fnu),
        "counts": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


def _write_sharded(dir_, tensors: dict[str, torch.Tensor]) -> None:
    dir_.mkdir(parents=True, exist_ok=True)
    items = list(tensors.items())
    save_safetensors(
        items[:3], dir_ / "model-00001-of-00002.safetensors", metadata={"format": "pt"}
    )
    save_safetensors(items[3:], dir_ / "model-00002-of-00002.safetensors")


def test_round_trip_is_bit_exact(tmp_path):
    _write_sharded(tmp_path / "ckpt", _tensors())
    got = dict(iter_safetensors(tmp_path / "ckpt"))
    assert {n: tensor_digest(t) for n, t in got.items()} == {
        n: tensor_digest(t) for n, t in _tensors().items()
    }


def test_interoperates_with_the_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    ours = {
        k: v for k, v in _tensors().items() if k != "e8m0_scales"
    }  # E8M0: newer safetensors only
    save_safetensors(ours.items(), tmp_path / "ours.safetensors")
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert {n: tensor_digest(t) for n, t in theirs.items()} == {
        n: tensor_digest(t) for n, t in ours.items()
    }
    st.save_file(ours, str(tmp_path / "theirs.safetensors"))
    back = dict(iter_safetensors(tmp_path / "theirs.safetensors"))
    assert {n: tensor_digest(t) for n, t in back.items()} == {
        n: tensor_digest(t) for n, t in ours.items()
    }


def test_digest_of_an_hf_checkpoint_matches_the_model(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    assert main(["digest", "--json", str(tmp_path / "hf")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {n: tensor_digest(t) for n, t in model.state_dict().items()}


def test_compare_identical_and_different(tmp_path, capsys):
    base = _tensors()
    _write_sharded(tmp_path / "a", base)
    save_safetensors(base.items(), tmp_path / "b.safetensors")  # same tensors, other sharding
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b.safetensors")]) == 0
    assert "identical: 7 tensors" in capsys.readouterr().out

    changed = dict(base)
    changed["model.norm.weight"] = torch.tensor([0.0, 0.0, 1.0])  # -0.0 became 0.0
    changed["counts"] = changed["counts"].to(torch.int32)
    del changed["empty"]
    changed["extra"] = torch.ones(1)
    _write_sharded(tmp_path / "c", changed)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "differs (bits): model.norm.weight" in out
    assert "differs (int64[5] vs int32[5]): counts" in out
    assert "only in A: empty" in out
    assert "only in B: extra" in out


def test_digest_prints_every_tensor(tmp_path, capsys):
    _write_sharded(tmp_path / "a", _tensors())
    assert main(["digest", str(tmp_path / "a")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7
    assert any(line.endswith("model.embed_tokens.weight  bfloat16[10, 4]") for line in lines)


def _corrupt_header(path, header: dict) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "no such file or directory"),
        (lambda d: d.mkdir(), "no *.safetensors files"),
        (lambda d: d.write_bytes(b"abc"), "too short"),
        (lambda d: d.write_bytes(struct.pack("<Q", 10**9) + b"{}"), "header length"),
        (lambda d: d.write_bytes(struct.pack("<Q", 4) + b"nope"), "not valid JSON"),
        (
            lambda d: _corrupt_header(
                d, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
            ),
            "expected 16 bytes",
        ),
        (
            lambda d: _corrupt_header(
                d, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}
            ),
            "does not support",
        ),
        (lambda d: _corrupt_header(d, {"w": {"shape": [2]}}), "lacks dtype"),
    ],
)
def test_bad_input_is_a_clear_error_with_exit_2(tmp_path, capsys, setup, message):
    bad = tmp_path / "bad.safetensors"
    setup(bad)
    assert main(["digest", str(bad)]) == 2
    assert message in capsys.readouterr().err
    _write_sharded(tmp_path / "good", _tensors())
    assert main(["compare", str(tmp_path / "good"), str(bad)]) == 2


def test_duplicate_names_across_shards_are_refused(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    save_safetensors([("w", torch.ones(1))], tmp_path / "d" / "a.safetensors")
    save_safetensors([("w", torch.ones(1))], tmp_path / "d" / "b.safetensors")
    assert main(["digest", str(tmp_path / "d")]) == 2
    assert "appears in both" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
