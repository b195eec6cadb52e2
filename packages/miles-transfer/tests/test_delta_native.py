"""The native disk-delta kernels give exactly the bytes and tensors of the PyTorch reference.

Chunk level: every instruction set this CPU has (AVX-512, AVX2, portable), every dtype a delta
stores, odd lengths, no change, all changed, the sparse/dense boundary, non-contiguous views,
malformed patches. File level: the delta directories are byte-identical, a delta written by
either path applies with the other, and deltas stored from the code before the native kernels
(data/) are written byte for byte the same today and apply.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from delta_golden import CHUNK_ELEMS, GOLDEN, checkpoints
from delta_testutil import base_tensors, same_files, step, write_checkpoint

import miles_transfer.delta.codec as codec
from miles_transfer._bytes import byte_view
from miles_transfer.checkpoint import SAFETENSORS_DTYPES
from miles_transfer.delta import encode_delta, materialize_delta
from miles_transfer.delta.encode import encode_checkpoints
from miles_transfer.delta.format import CheckpointIndex, MemoryCheckpoint
from miles_transfer.delta.materialize import materialize_checkpoint
from miles_transfer.delta.native import (
    StripeHash,
    _ext,
    delta_isa,
    delta_native_available,
    native_encode,
)

pytest.importorskip("xxhash")
pytestmark = pytest.mark.skipif(
    not delta_native_available(), reason="miles_transfer._ext built without the delta kernels"
)

ISAS = ["avx512", "avx2", "generic"]
ENCODINGS = ["xor", "overwrite"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one instruction set (skipped where the CPU lacks it)."""
    assert _ext is not None
    best = delta_isa()
    if not _ext.delta_use_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    try:
        yield request.param
    finally:
        _ext.delta_use_isa(best)


def _pair(n: int, dtype: torch.dtype, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two integer views of random bits; about ``frac`` of the elements differ in one byte."""
    g = torch.Generator().manual_seed(seed)
    w = dtype.itemsize
    base = torch.randint(0, 256, (n, w), generator=g, dtype=torch.uint8)
    new = base.clone()
    hit = torch.rand(n, generator=g) < frac
    lane = torch.randint(0, w, (n,), generator=g)
    rows = hit.nonzero().squeeze(1)
    new[rows, lane[rows]] ^= torch.randint(1, 256, (rows.numel(),), generator=g, dtype=torch.uint8)
    return codec.int_view(base.view(-1).view(dtype)), codec.int_view(new.view(-1).view(dtype))


def _roundtrip(base: torch.Tensor, new: torch.Tensor, encoding: str) -> None:
    """Native and torch encode to the same patch; both applies rebuild ``new`` exactly."""
    a = codec.encode_chunk(0, base, new, encoding, backend="torch")  # type: ignore[arg-type]
    b = codec.encode_chunk(0, base, new, encoding, backend="native")  # type: ignore[arg-type]
    assert a == b  # index, layout, changed, compressed bytes, raw size
    if a is None:
        assert torch.equal(base, new)
        return
    raw = codec.decompress(a.blob, a.raw_size)
    for backend in ("torch", "native"):
        target = base.clone()
        codec.apply_chunk(target, a.layout, a.changed, raw, encoding, backend=backend)  # type: ignore[arg-type]
        assert torch.equal(target, new), backend


@pytest.mark.parametrize("dtype_name", sorted(SAFETENSORS_DTYPES))
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_dtype_matches_torch(isa, dtype_name, encoding):
    dtype = SAFETENSORS_DTYPES[dtype_name]
    for n, frac, seed in [(1, 1.0, 0), (77, 0.05, 1), (1001, 0.02, 2), (4099, 0.5, 3)]:
        base, new = _pair(n, dtype, frac, seed)
        _roundtrip(base, new, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("n", [1, 2, 3, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 65537])
def test_odd_lengths_and_change_rates(isa, encoding, n):
    for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float64):
        for frac in (0.0, 0.01, 0.1, 0.3, 1.0):
            base, new = _pair(n, dtype, frac, seed=n)
            _roundtrip(base, new, encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_sparse_dense_boundary(isa, encoding):
    """Exactly n/8 changed stays sparse, one more goes dense, on both paths."""
    n = 800
    base = torch.zeros(n, dtype=torch.int16)
    for k, layout in ((n // 8, "sparse"), (n // 8 + 1, "dense"), (n, "dense"), (1, "sparse")):
        new = base.clone()
        new[torch.randperm(n, generator=torch.Generator().manual_seed(k))[:k]] = 7
        patch = codec.encode_chunk(0, base, new, encoding, backend="native")  # type: ignore[arg-type]
        assert patch is not None
        assert (patch.layout, patch.changed) == (layout, k)
        _roundtrip(base, new, encoding)


def test_change_in_last_element_and_high_byte_only(isa):
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for n in (1, 33, 64, 100):
            base, _ = _pair(n, dtype, 0.0, seed=5)
            new = base.clone()
            new.view(torch.uint8)[-1] ^= 0x80  # the top byte of the last element
            _roundtrip(base, new, "xor")
            new = base.clone()
            new.view(torch.uint8)[0] ^= 1  # the low byte of the first element
            _roundtrip(base, new, "overwrite")


def test_non_contiguous_views(isa):
    base, new = _pair(2000, torch.bfloat16, 0.05, seed=9)
    b2, n2 = base[::2], new[::2]
    assert not b2.is_contiguous()
    _roundtrip(b2, n2, "xor")
    patch = codec.encode_chunk(0, b2, n2, "xor", backend="native")
    assert patch is not None
    raw = codec.decompress(patch.blob, patch.raw_size)
    target = base.clone()
    codec.apply_chunk(target[::2], patch.layout, patch.changed, raw, "xor", backend="native")
    assert torch.equal(target[::2], n2)
    assert torch.equal(target[1::2], base[1::2])


@pytest.mark.parametrize(
    ("gaps", "message"),
    [
        ([3, 0], "not strictly increasing"),
        ([-1, 4], "not strictly increasing"),
        ([5, 2**31 - 1], "position"),
        ([99, 1], "position 100 >= chunk size 100"),
    ],
)
def test_malformed_sparse_chunks_write_nothing(isa, gaps, message):
    k, n = len(gaps), 100
    g = torch.tensor(gaps, dtype=torch.int32)
    vals = torch.arange(1, k + 1, dtype=torch.int16)
    planes = torch.cat([codec._shuffle(g), codec._shuffle(vals)])  # kept alive below
    raw = bytes(byte_view(planes))
    for backend in ("torch", "native"):
        target = torch.zeros(n, dtype=torch.int16)
        with pytest.raises(ValueError, match=message):
            codec.apply_chunk(target, "sparse", k, raw, "xor", backend=backend)  # type: ignore[arg-type]
        assert not target.any(), backend


def test_backend_argument_is_checked():
    t = torch.zeros(4, dtype=torch.int16)
    with pytest.raises(ValueError, match="backend must be"):
        codec.encode_chunk(0, t, t, "xor", backend="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_delta_files_identical_and_cross_apply(tmp_path: Path, encoding: str) -> None:
    """Both paths write the same delta bytes; each path's delta applies with the other."""
    base_t = base_tensors()
    new_t = step(base_t, 0.02, seed=1)
    new_t["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 128).bfloat16()  # dense
    new_t["added.weight"] = torch.randn(7, 9).bfloat16()  # odd length, no base
    base = write_checkpoint(tmp_path / "base", base_t)
    new = write_checkpoint(tmp_path / "new", new_t, shards=2)
    deltas = {}
    for backend in ("torch", "native"):
        out = tmp_path / f"delta-{backend}"
        encode_delta(base, new, out, encoding=encoding, chunk_elems=1000, backend=backend)  # type: ignore[arg-type]
        deltas[backend] = out
    assert same_files(deltas["torch"], deltas["native"])
    for made in ("torch", "native"):
        for applied in ("torch", "native"):
            out = tmp_path / f"out-{made}-{applied}"
            materialize_delta(base, deltas[made], out, backend=applied)  # type: ignore[arg-type]
            assert same_files(out, new), (made, applied)


@pytest.mark.parametrize("nbytes", [241, 256, 1023, 1024, 1025, 1088, 4096, 65536 + 64 * 3 + 17])
def test_native_xxh3_matches_xxhash(isa, nbytes):
    """Fed in one piece, in 64-byte pieces, or by the scan: xxhash's digest."""
    import xxhash

    g = torch.Generator().manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    want = xxhash.xxh3_128_hexdigest(byte_view(t))
    h = StripeHash(t)
    h.update(0, nbytes)
    assert h.hexdigest() == want
    h = StripeHash(t)
    for off in range(0, nbytes, 64):
        h.update(off, min(64, nbytes - off))
    assert h.hexdigest() == want
    for piece in (64, 128, 1024, 4096):
        if piece > nbytes:
            continue
        base = t.clone()
        base[::7] ^= 1
        hn, hb = StripeHash(t), StripeHash(base)
        for off in range(0, nbytes, piece):
            native_encode(base[off : off + piece], t[off : off + piece], True, 0, (hn, hb, off))
        assert hn.hexdigest() == want
        assert hb.hexdigest() == xxhash.xxh3_128_hexdigest(byte_view(base))


@pytest.mark.parametrize("chunk_elems", [32, 1024, 1 << 22])
def test_fused_checksums_in_manifest(tmp_path: Path, chunk_elems: int) -> None:
    """Chunks on 64-byte boundaries hash inside the scan: same manifest as the torch path."""
    base_t = base_tensors()
    new_t = step(base_t, 0.05, seed=3)
    base = write_checkpoint(tmp_path / "base", base_t)
    new = write_checkpoint(tmp_path / "new", new_t)
    for backend in ("torch", "native"):
        encode_delta(base, new, tmp_path / backend, chunk_elems=chunk_elems, backend=backend)  # type: ignore[arg-type]
    assert same_files(tmp_path / "torch", tmp_path / "native")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_fused_apply_from_memory_and_disk(isa, tmp_path: Path, encoding: str) -> None:
    """The fused copy+patch+hash apply: an in-memory base is read, never written; a base
    directory is patched in its fresh read; the results equal the torch path's bit for bit."""
    base_t = base_tensors()
    new_t = step(base_t, 0.03, seed=4)
    new_t["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 128).bfloat16()  # dense
    keep = {k: v.clone() for k, v in base_t.items()}
    base_mem = MemoryCheckpoint(list(base_t.items()))
    enc = encode_checkpoints(
        base_mem,
        MemoryCheckpoint(list(new_t.items())),
        tmp_path / "d",
        encoding=encoding,
        chunk_elems=1024,
    )
    assert enc.changed_elements > 0
    results = {}
    for backend in ("torch", "native"):
        for name, base in (("mem", base_mem), ("dir", CheckpointIndex(base_dir(tmp_path, base_t)))):
            _, got = materialize_checkpoint(
                base,
                tmp_path / "d",
                None,
                keep_tensors=True,
                backend=backend,  # type: ignore[arg-type]
            )
            results[backend, name] = got
            for k, v in got.items():
                assert torch.equal(v.view(torch.uint8), new_t[k].view(torch.uint8)), (
                    k,
                    backend,
                    name,
                )
    for k, v in keep.items():  # the in-memory base is unchanged
        assert torch.equal(base_mem.read(k).view(torch.uint8), v.view(torch.uint8)), k
    assert results["torch", "mem"].keys() == results["native", "dir"].keys()


def base_dir(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "base-dir"
    if not path.exists():
        write_checkpoint(path, tensors)
    return path


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_golden_deltas_from_before_the_native_kernels(isa, tmp_path: Path, encoding: str) -> None:
    """Deltas written by the code before the native kernels (data/, commit fa5661e): today's
    code, either path, writes the same bytes, and applies them to the same checkpoint."""
    base_t, new_t = checkpoints()
    base = write_checkpoint(tmp_path / "base", base_t)
    new = write_checkpoint(tmp_path / "new", new_t)
    golden = GOLDEN / f"golden-{encoding}"
    for backend in ("native", "torch"):
        out = tmp_path / f"delta-{backend}"
        encode_delta(base, new, out, encoding=encoding, chunk_elems=CHUNK_ELEMS, backend=backend)  # type: ignore[arg-type]
        assert same_files(out, golden), backend
        result = tmp_path / f"result-{backend}"
        materialize_delta(base, golden, result, backend=backend)  # type: ignore[arg-type]
        assert same_files(result, new), backend


def test_without_the_extension_deltas_take_the_torch_path(tmp_path: Path) -> None:
    """MILES_TRANSFER_DISABLE_NATIVE=1 (as without a compiler): same golden bytes, same result;
    backend='native' says what to do."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from delta_golden import CHUNK_ELEMS, GOLDEN, checkpoints\n"
        "from delta_testutil import same_files, write_checkpoint\n"
        "from miles_transfer.delta import encode_delta, materialize_delta\n"
        "from miles_transfer.delta.native import delta_native_available\n"
        "assert not delta_native_available()\n"
        "tmp = Path(sys.argv[1])\n"
        "base_t, new_t = checkpoints()\n"
        "base = write_checkpoint(tmp / 'base', base_t)\n"
        "new = write_checkpoint(tmp / 'new', new_t)\n"
        "encode_delta(base, new, tmp / 'd', chunk_elems=CHUNK_ELEMS)\n"
        "assert same_files(tmp / 'd', GOLDEN / 'golden-xor')\n"
        "materialize_delta(base, tmp / 'd', tmp / 'out')\n"
        "assert same_files(tmp / 'out', new)\n"
        "try:\n"
        "    encode_delta(base, new, tmp / 'd2', backend='native')\n"
        "except RuntimeError as e:\n"
        "    assert 'C++ compiler' in str(e) and 'MILES_TRANSFER_DISABLE_NATIVE' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('native backend ran without the extension')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, MILES_TRANSFER_DISABLE_NATIVE="1", OMP_NUM_THREADS="1")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
