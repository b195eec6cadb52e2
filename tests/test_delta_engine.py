"""Disk deltas into the embedded engine and into its SGLang-compatible server (cross-package).

A tiny Qwen3 is built from a config and trained one AdamW step; the bf16 checkpoints before
and after are the delta's base and result. The engine serves the base while a request is in
flight; the delta is materialized first, generation pauses only for the swap, and afterwards
the engine's weights equal the new checkpoint bit for bit. A refused update leaves the engine
serving the old version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from miles_rollout import EngineConfig, SamplingParams, serve
from miles_transfer import HTTPReceiver, tensor_digest, update_engine_from_delta
from miles_transfer.checkpoint import iter_safetensors, save_safetensors
from miles_transfer.delta import encode_delta, update_engine_via_disk

transformers = pytest.importorskip("transformers")
pytest.importorskip("xxhash")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("delta_engine")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(root / "base")
    model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (4, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.to(torch.bfloat16).save_pretrained(root / "new")
    return root / "base", root / "new"


def _digests(path: Path) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in iter_safetensors(path)}


def test_embedded_engine_applies_a_delta_pausing_only_for_the_swap(checkpoints, tmp_path):
    base, new = checkpoints
    encode_delta(base, new, tmp_path / "d", version="1")
    want = _digests(new)
    engine = EngineConfig(model_path=str(base), dtype="bfloat16").build()
    try:
        long = SamplingParams(max_new_tokens=120, ignore_eos=True, temperature=1.0)
        inflight = engine.submit([1, 2, 3], long)
        report = update_engine_from_delta(engine, base, tmp_path / "d")
        assert report.weight_version == "1"
        assert engine.weight_version == "1"
        assert 0 < report.changed_tensors <= len(want)
        assert report.pause_seconds > 0
        have = engine.weights_checksum(list(want))
        assert have == want  # bit for bit, every tensor of the new checkpoint
        out = inflight.result(timeout=120)  # in_place pause: the request went on
        assert len(out.output_ids) == 120
        assert out.weight_version == "1"
    finally:
        engine.shutdown()


def test_a_refused_update_keeps_the_engine_serving_the_old_version(checkpoints, tmp_path):
    base, new = checkpoints
    # A result with a tensor the engine does not have: decoded fine, refused by the engine.
    odd = Path(shutil.copytree(new, tmp_path / "odd"))
    extra = [("model.extra.weight", torch.ones(4, dtype=torch.bfloat16))]
    save_safetensors(extra, odd / "extra.safetensors")
    encode_delta(base, odd, tmp_path / "d", version="bad")
    engine = EngineConfig(model_path=str(base), dtype="bfloat16", weight_version="0").build()
    try:
        before = engine.weights_checksum()
        with pytest.raises(ValueError, match="unknown parameter names"):
            update_engine_from_delta(engine, base, tmp_path / "d")
        assert engine.weights_checksum() == before
        assert engine.weight_version == "0"
        assert not engine.server_info()["internal_states"][0]["paused"]
        out = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out.output_ids) == 4
        assert out.weight_version == "0"
    finally:
        engine.shutdown()


def test_sglang_disk_path_through_the_http_server(checkpoints, tmp_path):
    """The SGLang route: materialize the new checkpoint dir on the engine host, then one
    /update_weights_from_disk call between /pause_generation and /continue_generation."""
    base, new = checkpoints
    encode_delta(base, new, tmp_path / "d", version="1")
    engine = EngineConfig(model_path=str(base), dtype="bfloat16").build()
    try:
        with serve(engine) as handle:
            receiver = HTTPReceiver(handle.url)
            out_dir = tmp_path / "weight_v000001"
            report = update_engine_via_disk(receiver, base, tmp_path / "d", out_dir)
            assert report.weight_version == "1"
            assert engine.model_path == str(out_dir.resolve())
            assert engine.weight_version == "1"
            want = _digests(new)
            assert receiver.weights_checksum(list(want)) == want
            assert not engine.server_info()["internal_states"][0]["paused"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fmt", ["fp8_block128", "nvfp4"])
def test_publisher_diffs_in_quantized_rollout_precision(checkpoints, tmp_path, fmt):
    """precision="nvfp4" etc.: each version is exported by miles-quant and diffed in that
    layout; what a host pulls equals a direct export of the same weights, bit for bit."""
    pytest.importorskip("safetensors")
    mq = pytest.importorskip("miles_quant.checkpoint")
    from miles_transfer import DeltaPublisher, DeltaSubscriber

    base, new = checkpoints
    config = {"config.json": (base / "config.json").read_bytes()}
    pub = DeltaPublisher(tmp_path / "pub", precision=fmt, other_files=config)
    pub.publish(iter_safetensors(base))
    report = pub.publish(iter_safetensors(new))
    assert report.delta is not None
    assert report.delta.payload_bytes < report.full_bytes
    pulled = DeltaSubscriber(tmp_path / "pub", tmp_path / "host").pull()
    direct = tmp_path / "direct"
    mq.export_checkpoint(new, direct, fmt)
    got = dict(iter_safetensors(pulled.path))
    want = dict(iter_safetensors(direct))
    assert got.keys() == want.keys()
    assert any(t.dtype in (torch.float8_e4m3fn, torch.uint8) for t in want.values())
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
