"""Disk deltas: encode, materialize, apply in place (atomic), verify; corruption is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from delta_testutil import base_tensors, same_files, snapshot, step, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import miles_transfer.delta.codec as codec
from miles_transfer.checkpoint import iter_safetensors
from miles_transfer.delta import (
    DeltaBaseError,
    apply_delta,
    encode_delta,
    materialize_delta,
    recover_target,
    verify_delta,
)
from miles_transfer.delta.apply import JOURNAL

pytest.importorskip("xxhash")


@pytest.fixture
def ckpts(tmp_path: Path) -> tuple[Path, Path]:
    """A base checkpoint and its successor: 2% changed, one tensor replaced, one added, one
    removed, one reshaped, config changed, a file added."""
    base = base_tensors()
    new = step(base, 0.02, seed=1)
    new["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 128).bfloat16()  # all changed
    new["model.layers.1.new.weight"] = torch.randn(8, 8).bfloat16()
    del new["mask"]
    new["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    b = write_checkpoint(tmp_path / "base", base, shards=2)
    n = write_checkpoint(tmp_path / "new", new, config='{"model_type": "toy", "v": 2}', shards=2)
    (n / "generation_config.json").write_text("{}")
    return b, n


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_materialize_reproduces_the_new_checkpoint_byte_for_byte(ckpts, tmp_path, encoding):
    base, new = ckpts
    report = encode_delta(base, new, tmp_path / "d", encoding=encoding, chunk_elems=1000)
    assert report.encoding == encoding
    assert 0 < report.changed_fraction < 1
    assert report.payload_bytes < report.full_bytes
    assert sorted(os.listdir(tmp_path / "d")) == ["delta.bin", "delta.json"]
    before = snapshot(base)
    out = materialize_delta(base, tmp_path / "d", tmp_path / "out")
    assert same_files(tmp_path / "out", new)
    assert snapshot(base) == before  # the base is only read
    assert "model.layers.0.mlp.down_proj.weight" in out.changed
    assert "model.norm.weight" in out.changed
    assert "rotary.inv_freq" not in out.changed


def test_sparse_and_dense_chunks_and_unchanged_tensors_cost_nothing(tmp_path):
    base = {"a": torch.randn(10_000).bfloat16(), "b": torch.randn(5000).bfloat16()}
    new = {"a": base["a"].clone(), "b": base["b"].clone()}
    new["a"][:1000] = torch.randn(1000).bfloat16()  # chunk 0 dense, chunks 1..9 unchanged
    new["a"][5000] += 1  # one sparse element in chunk 5
    write_checkpoint(tmp_path / "b", base)
    write_checkpoint(tmp_path / "n", new)
    encode_delta(tmp_path / "b", tmp_path / "n", tmp_path / "d", chunk_elems=1000)
    m = json.loads((tmp_path / "d" / "delta.json").read_text())
    assert m["tensors"]["b"]["op"] == "keep"
    assert m["tensors"]["b"]["chunks"] == []
    layouts = {c[0]: c[1] for c in m["tensors"]["a"]["chunks"]}
    assert layouts == {0: "dense", 5: "sparse"}
    materialize_delta(tmp_path / "b", tmp_path / "d", tmp_path / "o")
    assert same_files(tmp_path / "o", tmp_path / "n")


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3000),
    frac=st.sampled_from([0.0, 0.001, 0.05, 0.3, 1.0]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e5m2, torch.float64]),
    chunk=st.sampled_from([1, 7, 256, 4096]),
    encoding=st.sampled_from(["xor", "overwrite"]),
    seed=st.integers(0, 2**16),
)
def test_chunk_codec_round_trips_bit_for_bit(n, frac, dtype, chunk, encoding, seed):
    g = torch.Generator().manual_seed(seed)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    base = torch.randint(-(2**7), 2**7, (n,), generator=g, dtype=torch.int64).to(ints)
    new = base.clone()
    hit = torch.rand(n, generator=g) < frac
    new[hit] = torch.randint(-(2**7), 2**7, (int(hit.sum()),), generator=g).to(ints)
    target = base.clone()
    for i, s in enumerate(range(0, n, chunk)):
        patch = codec.encode_chunk(i, base[s : s + chunk], new[s : s + chunk], encoding)
        if patch is None:
            assert torch.equal(base[s : s + chunk], new[s : s + chunk])
            continue
        raw = codec.decompress(patch.blob, patch.raw_size)
        codec.apply_chunk(target[s : s + chunk], patch.layout, patch.changed, raw, encoding)
    assert torch.equal(target, new)


def test_overwrite_is_idempotent_and_xor_applies_exactly_once(ckpts, tmp_path):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "x", encoding="xor")
    encode_delta(base, new, tmp_path / "o", encoding="overwrite")
    t = Path(shutil.copytree(base, tmp_path / "t"))
    (t / "notes.txt").write_text("mine")  # a file the delta does not know: left alone
    apply_delta(t, tmp_path / "o")
    assert (t / "notes.txt").read_text() == "mine"
    (t / "notes.txt").unlink()
    assert same_files(t, new)
    apply_delta(t, tmp_path / "o")  # again: same result
    assert same_files(t, new)
    assert verify_delta(t, tmp_path / "x").state == "applied"
    before = snapshot(t)
    with pytest.raises(DeltaBaseError, match="already holds this delta's result"):
        apply_delta(t, tmp_path / "x")
    assert snapshot(t) == before


def test_xor_refuses_a_wrong_base_and_leaves_it_untouched(ckpts, tmp_path):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "d", encoding="xor", base_version="7")
    other = write_checkpoint(tmp_path / "other", step(base_tensors(), 0.01, seed=9), shards=2)
    before = snapshot(other)
    with pytest.raises(DeltaBaseError, match="neither the delta's base nor its result"):
        apply_delta(other, tmp_path / "d")
    with pytest.raises(DeltaBaseError):
        verify_delta(other, tmp_path / "d")
    assert snapshot(other) == before
    # A checkpoint with the wrong tensors is refused before any work, naming the base version.
    odd = write_checkpoint(tmp_path / "odd", {"x": torch.zeros(3)})
    with pytest.raises(DeltaBaseError, match="base version '7'"):
        apply_delta(odd, tmp_path / "d")


def test_overwrite_on_a_third_version_is_refused_by_the_result_checksum(ckpts, tmp_path):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "d", encoding="overwrite")
    other = write_checkpoint(tmp_path / "other", step(base_tensors(), 0.05, seed=3), shards=2)
    before = snapshot(other)
    with pytest.raises(DeltaBaseError, match="result checksum"):
        apply_delta(other, tmp_path / "d")
    assert snapshot(other) == before


def _corrupt_payload(d: Path) -> None:
    p = d / "delta.bin"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    p.write_bytes(bytes(raw))


def _truncate_payload(d: Path) -> None:
    p = d / "delta.bin"
    p.write_bytes(p.read_bytes()[:-10])


def _forge_checksum(d: Path) -> None:
    p = d / "delta.json"
    m = json.loads(p.read_text())
    m["tensors"]["model.norm.weight"]["checksum"] = "0" * 32
    p.write_text(json.dumps(m))


def _break_json(d: Path) -> None:
    p = d / "delta.json"
    p.write_text(p.read_text()[:100])


def _drop_payload(d: Path) -> None:
    (d / "delta.bin").unlink()


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        (_corrupt_payload, ValueError, "corrupted"),
        (_truncate_payload, ValueError, "truncated"),
        (_forge_checksum, DeltaBaseError, "model.norm.weight"),
        (_break_json, ValueError, "not valid JSON"),
        (_drop_payload, ValueError, "delta.bin is missing"),
    ],
)
def test_a_damaged_delta_is_refused_and_the_target_is_unchanged(
    ckpts, tmp_path, damage, error, match
):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "d", encoding="overwrite")
    damage(tmp_path / "d")
    before = snapshot(base)
    with pytest.raises(error, match=match):
        apply_delta(base, tmp_path / "d")
    with pytest.raises(error, match=match):
        verify_delta(base, tmp_path / "d")
    assert snapshot(base) == before


def test_a_failure_during_the_swap_rolls_back_byte_for_byte(ckpts, tmp_path, monkeypatch):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "d")
    before = snapshot(base)
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(src)
        if len(calls) == 5:  # after the old files moved out and some new ones moved in
            raise OSError("disk on fire")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="disk on fire"):
        apply_delta(base, tmp_path / "d")
    monkeypatch.undo()
    assert len(calls) > 5  # the failure happened mid-swap, and the rollback ran
    assert snapshot(base) == before


def test_recover_rolls_back_a_swap_interrupted_by_a_crash(ckpts, tmp_path, monkeypatch):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "d")
    before = snapshot(base)
    real = os.replace
    calls = []

    def dies(src, dst):
        calls.append(src)
        if len(calls) >= 5:  # a crash: this and every later rename (the rollback too) fail
            raise SystemExit("killed")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(SystemExit):
        apply_delta(base, tmp_path / "d")
    monkeypatch.undo()
    assert (base / JOURNAL).exists()
    with pytest.raises(ValueError, match="interrupted apply"):
        verify_delta(base, tmp_path / "d")
    assert recover_target(base)
    assert snapshot(base) == before
    apply_delta(base, tmp_path / "d")  # and it applies cleanly afterwards
    assert same_files(base, new)


def test_encode_refuses_a_non_empty_out_and_leaves_nothing_on_error(ckpts, tmp_path):
    base, new = ckpts
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        encode_delta(base, new, tmp_path / "busy")
    with pytest.raises(ValueError, match="encoding must be one of"):
        encode_delta(base, new, tmp_path / "d", encoding="zip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a directory"):
        encode_delta(tmp_path / "nope", new, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "busy", "new"]


def test_tensors_read_back_equal_the_new_ones(ckpts, tmp_path):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "d")
    materialize_delta(base, tmp_path / "d", tmp_path / "o")
    got = dict(iter_safetensors(tmp_path / "o"))
    want = dict(iter_safetensors(new))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))


def test_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(codec, "_mods", {})

    def no_module(name: str):
        raise ImportError(name)

    monkeypatch.setattr(codec.importlib, "import_module", no_module)
    with pytest.raises(ImportError, match=r"pip install 'miles-transfer\[delta\]'"):
        codec.checksum(torch.zeros(2))


def test_worker_threads_write_the_same_bytes(ckpts, tmp_path, monkeypatch):
    base, new = ckpts
    encode_delta(base, new, tmp_path / "serial", chunk_elems=500)
    monkeypatch.setenv("MILES_DELTA_WORKERS", "3")
    encode_delta(base, new, tmp_path / "threads", chunk_elems=500)
    assert snapshot(tmp_path / "serial") == snapshot(tmp_path / "threads")
    materialize_delta(base, tmp_path / "threads", tmp_path / "out")
    assert same_files(tmp_path / "out", new)
    monkeypatch.setenv("MILES_DELTA_WORKERS", "two")
    with pytest.raises(ValueError, match="MILES_DELTA_WORKERS"):
        encode_delta(base, new, tmp_path / "bad")


def test_a_chain_applied_at_once_equals_the_steps_one_by_one(tmp_path):
    from miles_transfer.delta.chain import materialize_chain

    v0 = base_tensors()
    v1 = step(v0, 0.05, seed=1)
    v1["added.weight"] = torch.randn(4, 4).bfloat16()  # added in v1, changed in v2
    v2 = step(v1, 0.05, seed=2)
    del v2["mask"]  # removed in v2
    v2["fp8.weight"] = torch.randn(8, 8).to(torch.float8_e4m3fn)  # reshaped in v2
    v3 = step(v2, 0.05, seed=3)
    dirs = [
        write_checkpoint(tmp_path / f"v{i}", v, config=f'{{"v": {i}}}', shards=2)
        for i, v in enumerate([v0, v1, v2, v3])
    ]
    deltas = []
    for i, enc in zip(range(1, 4), ["xor", "overwrite", "xor"], strict=True):
        r = encode_delta(dirs[i - 1], dirs[i], tmp_path / f"d{i}", encoding=enc, chunk_elems=700)
        deltas.append(r.path)
    report = materialize_chain(dirs[0], deltas, tmp_path / "chained")
    assert same_files(tmp_path / "chained", dirs[3])
    assert "added.weight" in report.changed
    with pytest.raises(DeltaBaseError):  # not the chain's base: refused, nothing written
        materialize_chain(dirs[1], deltas, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
    _corrupt_payload(deltas[1])
    with pytest.raises(ValueError, match="corrupted"):
        materialize_chain(dirs[0], deltas, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
