"""push_weights into a ModuleReceiver: casting, buckets, versions, verification, all-or-nothing."""

from __future__ import annotations

import pytest
import torch

from miles_transfer import ModuleReceiver, SyncReport, WeightReceiver, push_weights, tensor_digest
from miles_transfer.push import WeightMismatchError, iter_full_state


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(32, 8),
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 32),
    )


class Recording(ModuleReceiver):
    def __init__(self, module: torch.nn.Module, **kw) -> None:
        super().__init__(module, **kw)
        self.calls: list[tuple[list[str], str | None, bool]] = []

    def update_weights_from_tensor(self, named_tensors, *, weight_version=None, flush_cache=True):
        items = list(named_tensors)
        self.calls.append(([n for n, _ in items], weight_version, flush_cache))
        super().update_weights_from_tensor(
            items, weight_version=weight_version, flush_cache=flush_cache
        )


def test_module_receiver_is_a_weight_receiver():
    assert isinstance(ModuleReceiver(_model(0)), WeightReceiver)


def test_push_then_checksums_equal_and_bits_match():
    src, dst = _model(0), _model(1)
    rx = ModuleReceiver(dst)
    report = push_weights(iter_full_state(src), rx, weight_version="1")
    assert isinstance(report, SyncReport)
    assert report.verified
    assert report.tensors == len(src.state_dict())
    assert report.bytes == sum(t.numel() * t.element_size() for t in src.state_dict().values())
    assert rx.weights_checksum() == {n: tensor_digest(t) for n, t in src.state_dict().items()}
    assert rx.weight_version == "1"
    assert "verified bit-exact" in report.summary()


def test_cast_to_receiver_dtype_and_version_rides_on_last_bucket():
    src = _model(0)
    rx = Recording(_model(1), dtype=torch.bfloat16)
    report = push_weights(iter_full_state(src), rx, weight_version="5", bucket_bytes=300)
    assert report.buckets == len(rx.calls) > 2
    assert [v for _, v, _ in rx.calls] == [None] * (len(rx.calls) - 1) + ["5"]
    assert [f for _, _, f in rx.calls] == [False] * (len(rx.calls) - 1) + [True]
    for name, t in src.state_dict().items():
        assert tensor_digest(rx.module.state_dict()[name]) == tensor_digest(t.to(torch.bfloat16))
    assert report.bytes == sum(t.numel() * 2 for t in src.state_dict().values())


def test_corrupted_receiver_weight_is_detected_and_named():
    class Corrupting(ModuleReceiver):
        def update_weights_from_tensor(self, named_tensors, **kw):
            super().update_weights_from_tensor(named_tensors, **kw)
            with torch.no_grad():
                w = self.module[1].weight
                w.view(-1)[3] = torch.nextafter(w.view(-1)[3], torch.tensor(float("inf")))

    with pytest.raises(WeightMismatchError) as info:
        push_weights(iter_full_state(_model(0)), Corrupting(_model(1)), weight_version="1")
    assert info.value.mismatched == ["1.weight"]
    assert "1.weight" in str(info.value)


def test_verify_false_skips_the_check():
    class Lossy(ModuleReceiver):
        def weights_checksum(self, names=None):
            raise AssertionError("must not be called")

    report = push_weights(
        iter_full_state(_model(0)), Lossy(_model(1)), weight_version="1", verify=False
    )
    assert not report.verified
    assert report.verify_seconds == 0.0


def test_missing_checksum_counts_as_mismatch():
    class Forgetful(ModuleReceiver):
        def weights_checksum(self, names=None):
            out = super().weights_checksum(names)
            out.pop("3.bias")
            return out

    with pytest.raises(WeightMismatchError, match=r"3\.bias"):
        push_weights(iter_full_state(_model(0)), Forgetful(_model(1)), weight_version="1")


def test_all_or_nothing_on_bad_name_or_shape():
    rx = ModuleReceiver(_model(1))
    before = rx.weights_checksum()
    good = list(iter_full_state(_model(0)))
    with pytest.raises(ValueError, match="no such parameter"):
        rx.update_weights_from_tensor(
            [*good, ("model.nope.weight", torch.zeros(1))], weight_version="2"
        )
    bad_shape = [*good[:-1], (good[-1][0], torch.zeros(3))]
    with pytest.raises(ValueError, match=r"got torch\.float32\[3\]"):
        rx.update_weights_from_tensor(bad_shape, weight_version="2")
    with pytest.raises(ValueError, match=r"torch\.bfloat16"):
        rx.update_weights_from_tensor([(good[0][0], good[0][1].bfloat16())])
    assert rx.weights_checksum() == before
    assert rx.weight_version == "0"


def test_duplicate_names_and_empty_stream_are_refused():
    rx = ModuleReceiver(_model(1))
    w = _model(0)[1].weight.detach()
    with pytest.raises(ValueError, match="twice"):
        push_weights([("1.weight", w), ("1.weight", w)], rx, weight_version="1")
    with pytest.raises(ValueError, match="no tensors"):
        push_weights([], rx, weight_version="1")


def test_module_receiver_dtype_rules():
    mixed = _model(0)
    mixed[2].to(torch.float64)
    with pytest.raises(ValueError, match="pass dtype"):
        ModuleReceiver(mixed)
    rx = ModuleReceiver(mixed, dtype=torch.bfloat16)
    assert {t.dtype for t in rx.module.state_dict().values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="floating-point"):
        ModuleReceiver(_model(0), dtype=torch.int8)
    with pytest.raises(ValueError, match="unknown weight names"):
        rx.weights_checksum(["nope"])


def test_tied_weights_are_pushed_under_both_names():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)
            self.lm_head = torch.nn.Linear(4, 16, bias=False)
            self.lm_head.weight = self.embed.weight

    torch.manual_seed(0)
    src = Tied()
    torch.manual_seed(1)
    rx = ModuleReceiver(Tied())
    push_weights(iter_full_state(src), rx, weight_version="1")
    assert rx.module.lm_head.weight is rx.module.embed.weight
    assert torch.equal(rx.module.embed.weight, src.embed.weight)
