"""The weight payload without pickle (``miles_safetensors``) and the weight server's API key
(issue 31): bits survive for every dtype, a hostile payload is refused naming the field, the
server refuses pickles and unauthenticated requests, and nothing is left in /dev/shm."""

from __future__ import annotations

import json
import os
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles_transfer.push import (
    HTTPReceiver,
    ModuleReceiver,
    ReceiverError,
    WeightServer,
    deserialize_named_tensors,
    discard_serialized,
    push_weights,
    serialize_named_tensors,
)
from miles_transfer.push.safe_wire import SAFE_FORMAT, parse_safetensors

SHM = Path("/dev/shm")


@pytest.fixture
def no_leak() -> Iterator[None]:
    before = set(SHM.glob("miles-weights-*"))
    yield
    assert set(SHM.glob("miles-weights-*")) == before


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.f32", torch.randn(3, 5, generator=g)),
        ("b.bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.f16", torch.randn(2, 2, generator=g).half()),
        ("d.fp8", torch.randn(9, generator=g).to(torch.float8_e4m3fn)),
        ("e.i64", torch.arange(5)),
        ("f.bool", torch.tensor([True, False, True])),
        ("g.empty", torch.zeros(0, 4)),
        ("h.scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("i.strided", torch.randn(4, 6, generator=g)[:, ::2]),  # not contiguous
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_round_trip_is_bit_exact_for_every_dtype(no_leak: None) -> None:
    items = _tensors()
    payload = serialize_named_tensors(items, load_format=SAFE_FORMAT)
    try:
        assert set(json.loads(payload)) == {"path"}  # only a file name travels
        got = deserialize_named_tensors(payload, load_format=SAFE_FORMAT, allow_pickle=False)
        again = deserialize_named_tensors(payload, load_format=SAFE_FORMAT)  # read twice: fine
    finally:
        discard_serialized(payload, load_format=SAFE_FORMAT)
    assert [n for n, _ in got] == [n for n, _ in items]
    for (_, want), (_, t), (_, t2) in zip(items, got, again):
        assert t.dtype == want.dtype
        assert t.shape == want.shape
        assert torch.equal(_bits(t), _bits(want))
        assert torch.equal(_bits(t2), _bits(t))
    # A standard safetensors reader reads the same file format.
    safetensors = pytest.importorskip("safetensors.torch")
    image = bytearray(safetensors.save({n: t.contiguous() for n, t in items}))
    for (n, t), (m, u) in zip(sorted(items), sorted(parse_safetensors(image, "x"))):
        assert n == m
        assert torch.equal(_bits(u), _bits(t))


def _file(header: object, data: bytes = b"", raw_len: int | None = None) -> str:
    head = json.dumps(header).encode()
    path = SHM / f"miles-weights-{os.urandom(16).hex()}.safetensors"
    path.write_bytes(struct.pack("<Q", len(head) if raw_len is None else raw_len) + head + data)
    return json.dumps({"path": str(path)})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: json.dumps({"path": "/etc/passwd"}), "is not a miles_safetensors file"),
        (lambda: json.dumps({"path": "/dev/shm/../etc/x.safetensors"}), "is not a"),
        (lambda: json.dumps({"path": "/dev/shm/x", "extra": 1}), 'exactly {"path"'),
        (lambda: "not json", "payload is JSON"),
        (lambda: json.dumps({"path": str(SHM / f"miles-weights-{'0' * 32}.safetensors")}), "open"),
        (lambda: _file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), "inside"),
        (
            lambda: _file({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"x" * 8),
            "do not hold 3",
        ),
        (
            lambda: _file({"w": {"dtype": "PY_OBJECT", "shape": [1], "data_offsets": [0, 1]}}),
            "dtype 'PY_OBJECT' is not one of",
        ),
        (
            lambda: _file({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
            "shape [-1]",
        ),
        (lambda: _file({"w": {"dtype": "U8"}}), "must be {dtype, shape, data_offsets}"),
        (lambda: _file([1, 2]), "a JSON list, not an object"),
        (lambda: _file({}, raw_len=1 << 40), "does not fit the file"),
    ],
)
def test_hostile_payloads_are_refused_naming_the_field(make, message: str, no_leak) -> None:
    payload = make()
    try:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
            deserialize_named_tensors(payload, load_format=SAFE_FORMAT, allow_pickle=False)
    finally:
        path = Path(json.loads(payload)["path"]) if payload.startswith("{") else None
        if path is not None and path.parent == SHM and path.name.startswith("miles-weights-"):
            path.unlink(missing_ok=True)


def test_a_link_is_not_followed(tmp_path: Path, no_leak: None) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not weights")
    link = SHM / f"miles-weights-{os.urandom(16).hex()}.safetensors"
    link.symlink_to(secret)
    try:
        with pytest.raises(ValueError, match="cannot open the payload file"):
            deserialize_named_tensors(json.dumps({"path": str(link)}), load_format=SAFE_FORMAT)
    finally:
        link.unlink()


def test_pickled_payloads_are_refused_unless_allowed(no_leak: None) -> None:
    payload = serialize_named_tensors(_tensors()[:1], load_format="flattened_bucket")
    with pytest.raises(ValueError, match="pickles, which this server does not accept"):
        deserialize_named_tensors(payload, load_format="flattened_bucket", allow_pickle=False)
    (name, _), *_ = deserialize_named_tensors(payload, load_format="flattened_bucket")
    assert name == "a.f32"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _get(url: str, key: str | None = None, data: bytes | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _announce_body(url: str, path: str, length: int) -> int:
    """POST headers announcing a ``length``-byte body, none of it sent: the status."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Authorization", "Bearer k")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def test_weight_server_with_a_key_and_the_safe_format(no_leak: None) -> None:
    dst = _model()
    src = [(n, t + 1) for n, t in dst.state_dict().items()]
    with WeightServer(ModuleReceiver(dst), api_key="k") as server:
        assert _get(server.url + "/health") == 200  # the probe stays open
        for path in ("/get_server_info", "/weights_checksum"):
            assert _get(server.url + path) == 401
            assert _get(server.url + path, "wrong") == 401
        body = json.dumps({"serialized_named_tensors": ["x"]}).encode()
        assert _get(server.url + "/update_weights_from_tensor", None, body) == 401
        with pytest.raises(ReceiverError, match="401"):
            HTTPReceiver(server.url)
        rx = HTTPReceiver(server.url, api_key="k")
        assert rx.load_format == SAFE_FORMAT  # offered by the server, picked by the client
        assert push_weights(src, rx, weight_version="1").verified
        # An SGLang-style pickled push is refused whole: the weights stay.
        pickled = HTTPReceiver(server.url, api_key="k", load_format="flattened_bucket")
        with pytest.raises(ReceiverError, match="pickles"):
            pickled.update_weights_from_tensor([(n, t + 5) for n, t in src])
        assert all(torch.equal(dst.state_dict()[n], t) for n, t in src)
        assert _announce_body(server.url, "/update_weights_from_tensor", 65 << 20) == 413
    with pytest.raises(ValueError, match="--insecure-no-auth"):
        WeightServer(ModuleReceiver(_model()), host="0.0.0.0")
