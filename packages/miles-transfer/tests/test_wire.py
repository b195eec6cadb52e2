"""SGLang wire format: bit-exact across processes, no /dev/shm leaks, restricted unpickling."""

from __future__ import annotations

import base64
import gc
import glob
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from miles_transfer import tensor_digest
from miles_transfer.push import (
    deserialize_named_tensors,
    discard_serialized,
    serialize_named_tensors,
)
from miles_transfer.push.wire import _WireUnpickler

FORMATS = [None, "flattened_bucket"]


def _shm_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


@pytest.fixture
def no_shm_leak():
    gc.collect()
    before = _shm_files()
    yield
    # Freed storages' files can be unlinked a moment later (torch_shm_manager, or the
    # file_system sharing strategy another test of the batch may have set): wait for it.
    deadline = time.monotonic() + 20
    gc.collect()
    while _shm_files() - before and time.monotonic() < deadline:
        time.sleep(0.2)
        gc.collect()
    assert _shm_files() - before == set(), "shared-memory files left behind"


def _special_f32() -> torch.Tensor:
    bits = torch.tensor(
        [0x00000000, 0x80000000, 0x7FC00001, 0xFFC12345, 0x7F800000, 1], dtype=torch.int64
    )
    return bits.to(torch.int32).view(torch.float32)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 7, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", _special_f32()),
        ("scalar", torch.tensor(-0.0)),
        ("int_buffer", torch.arange(9, dtype=torch.int64).view(3, 3)),
        ("empty", torch.empty(0, 4)),
        ("fp8", torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn)),
        ("strided", torch.randn(6, 4, generator=g).t()),
    ]


def _digests(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    return [(n, tensor_digest(t)) for n, t in named]


@pytest.mark.parametrize("load_format", FORMATS)
def test_round_trip_in_process_is_bit_exact(load_format, no_shm_leak):
    sent = _tensors()
    payload = serialize_named_tensors(sent, load_format=load_format)
    got = deserialize_named_tensors(payload, load_format=load_format)
    assert _digests(got) == _digests(sent)
    del got


@pytest.mark.parametrize("load_format", FORMATS)
def test_uniform_bf16_bucket_round_trip(load_format, no_shm_leak):
    sent = [(n, t.to(torch.bfloat16)) for n, t in _tensors() if t.is_floating_point()]
    got = deserialize_named_tensors(
        serialize_named_tensors(sent, load_format=load_format), load_format=load_format
    )
    assert _digests(got) == _digests(sent)


def test_caller_tensors_stay_private(no_shm_leak):
    t = torch.randn(4, 4)
    ptr = t.untyped_storage().data_ptr()
    payload = serialize_named_tensors([("w", t)])
    assert t.untyped_storage().data_ptr() == ptr, (
        "the caller's storage must not move to shared memory"
    )
    t.add_(1.0)  # mutating after serialisation must not change what was sent
    ((_name, got),) = deserialize_named_tensors(payload)
    assert not torch.equal(got, t)
    del got


# The reader imports miles-transfer as installed for this interpreter (editable in the dev venv,
# the built wheel with its native extension under Pants), not from the source tree.
_CHILD = textwrap.dedent(
    """
    import gc, json, sys
    from miles_transfer import tensor_digest
    from miles_transfer.push import deserialize_named_tensors
    out = deserialize_named_tensors(sys.stdin.read(), load_format={fmt!r})
    print(json.dumps([[n, tensor_digest(t)] for n, t in out]))
    del out
    gc.collect()
    """
)


@pytest.mark.parametrize("load_format", FORMATS)
def test_round_trip_across_a_process_boundary(load_format, no_shm_leak):
    sent = _tensors()
    payload = serialize_named_tensors(sent, load_format=load_format)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(fmt=load_format)],
        input=payload,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"reader exited {proc.returncode}:\n{proc.stderr}"
    got = [tuple(p) for p in json.loads(proc.stdout)]
    assert got == _digests(sent)


def test_flattened_uniform_dtype_uses_element_indices():
    """Single-dtype buckets are flattened in their own dtype: readable by old and new SGLang."""
    sent = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    obj = _unpickled_object(serialize_named_tensors(sent, load_format="flattened_bucket"))
    flat, meta = obj["flattened_tensor"], obj["metadata"]
    assert flat.dtype == torch.float32
    assert flat.numel() == 7
    assert [(m.name, tuple(m.shape), m.start_idx, m.end_idx, m.numel) for m in meta] == [
        ("a", (3,), 0, 3, 3),
        ("b", (2, 2), 3, 7, 4),
    ]
    del flat, obj, meta


def test_flattened_mixed_dtypes_use_aligned_bytes():
    sent = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(2))]
    obj = _unpickled_object(serialize_named_tensors(sent, load_format="flattened_bucket"))
    flat, meta = obj["flattened_tensor"], obj["metadata"]
    assert flat.dtype == torch.uint8
    assert [(m.start_idx, m.end_idx, m.numel) for m in meta] == [(0, 6, 6), (16, 24, 8)]
    del flat, obj, meta


def _unpickled_object(payload: str):
    return _WireUnpickler(io.BytesIO(base64.b64decode(payload))).load()


def test_payload_names_only_sglang_allowlisted_globals(no_shm_leak):
    """SGLang's SafeUnpickler admits torch.*, copyreg.* and its tensor_bucket module only."""
    seen: list[str] = []

    class Recorder(_WireUnpickler):
        def find_class(self, module, name):
            seen.append(module)
            return super().find_class(module, name)

    payload = serialize_named_tensors(_tensors(), load_format="flattened_bucket")
    obj = Recorder(io.BytesIO(base64.b64decode(payload))).load()
    del obj
    assert "sglang.srt.weight_sync.tensor_bucket" in seen
    for module in seen:
        assert module.startswith(("torch", "copyreg", "sglang.srt.weight_sync.tensor_bucket")), (
            module
        )


def test_two_consumers_each_read_once(no_shm_leak):
    sent = _tensors()
    payload = serialize_named_tensors(sent, consumers=2)
    first = deserialize_named_tensors(payload)
    del first
    gc.collect()
    second = deserialize_named_tensors(payload)  # still there for the second TP rank
    assert _digests(second) == _digests(sent)
    del second


@pytest.mark.parametrize("load_format", FORMATS)
def test_discard_releases_an_unread_payload(load_format, no_shm_leak):
    payload = serialize_named_tensors(_tensors(), load_format=load_format, consumers=2)
    gc.collect()
    assert _shm_files(), "the payload should hold a shared-memory file"
    discard_serialized(payload, load_format=load_format, consumers=2)


def test_forbidden_global_is_refused():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    payload = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    with pytest.raises(ValueError, match="refusing to unpickle"):
        deserialize_named_tensors(payload)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="at least one tensor"):
        serialize_named_tensors([])
    with pytest.raises(ValueError, match="base64"):
        deserialize_named_tensors("not base64 !!")
    with pytest.raises(ValueError, match="consumers"):
        serialize_named_tensors([("a", torch.ones(1))], consumers=0)
    with pytest.raises(ValueError, match="one device"):
        serialize_named_tensors([("a", torch.ones(1)), ("b", torch.ones(1, device="meta"))])
    payload = serialize_named_tensors([("a", torch.ones(2))])
    with pytest.raises(ValueError, match="flattened_bucket payload"):
        deserialize_named_tensors(payload, load_format="flattened_bucket")
    payload = serialize_named_tensors([("a", torch.ones(2))], load_format="flattened_bucket")
    with pytest.raises(ValueError, match="list of"):
        deserialize_named_tensors(payload)
