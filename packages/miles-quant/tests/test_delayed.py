"""DelayedScaler: amax-history (delayed) per-tensor FP8 scaling, checked against a hand
computation, across backends, for NaN/Inf policy, and through state_dict round trips."""

from __future__ import annotations

import pytest
import torch
from _quant_testlib import NATIVE_DISABLED, bits

import miles_quant as mq

BACKENDS = ["torch"] if NATIVE_DISABLED else ["native", "torch"]


def _step(amax: float, n: int = 64) -> torch.Tensor:
    """A bf16 tensor whose amax is exactly `amax` (a power of two times small integers)."""
    x = torch.linspace(-1, 1, n) * amax
    x[3] = -amax
    return x.to(torch.bfloat16)


def _by_hand(x: torch.Tensor, amax_used: float, fmt: str, margin: int = 0) -> tuple:
    """The scale and codes written out with torch's saturating float8 casts."""
    el = mq.FORMATS[fmt].element
    assert el is not None
    assert el.torch_dtype is not None
    s = torch.tensor(max(amax_used, 1e-10), dtype=torch.float32) / el.max_value
    s = s * 2.0**margin
    y = x.float() / s
    if fmt == "fp8_e5m2":  # torch's E5M2 cast overflows to Inf; the contract saturates
        y = y.clamp(-el.max_value, el.max_value)
    return s, y.to(el.torch_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_scale_is_the_history_max_and_matches_a_hand_computation(backend: str, fmt: str) -> None:
    sc = mq.DelayedScaler(fmt, history=3, backend=backend)  # type: ignore[arg-type]
    amaxes = [1.0, 4.0, 2.0, 0.5, 0.25, 0.125]
    # Call 1 uses its own amax; later calls the max of the last 3 recorded.
    used = [1.0, 1.0, 4.0, 4.0, 4.0, 2.0]
    assert sc.next_amax() is None
    for a, u in zip(amaxes, used, strict=True):
        x = _step(a)
        q = sc.quantize(x)
        s, codes = _by_hand(x, u, fmt)
        assert bits(q.scales).item() == bits(s).item(), (a, u)
        assert torch.equal(bits(q.data), bits(codes)), (a, u)
        assert (q.format, q.granularity, q.shape, q.dtype) == (fmt, "tensor", (64,), x.dtype)
    assert sc.amax_history.tolist() == [0.5, 0.25, 0.125]


def test_values_above_the_history_max_saturate() -> None:
    sc = mq.DelayedScaler("fp8_e4m3", history=2)
    sc.quantize(_step(1.0))
    q = sc.quantize(_step(4.0))  # scaled for amax 1: |x| > 1 clamps to +-448
    x = _step(4.0).float()
    mag = q.data.view(torch.uint8) & 0x7F
    assert (mag[x.abs() > 1] == 0x7E).all()  # the -4 at index 3 and every |x| > 1
    assert (mag[x.abs() <= 1] < 0x7E).all()
    assert torch.equal(mq.dequantize(q).abs().max(), 448 * q.scales)


def test_margin_and_a_single_slot_history() -> None:
    sc = mq.DelayedScaler("fp8_e4m3", history=1, margin=2)
    for a, u in [(3.0, 3.0), (6.0, 3.0), (0.5, 6.0)]:
        x = _step(a)
        q = sc.quantize(x)
        s, codes = _by_hand(x, u, "fp8_e4m3", margin=2)
        assert bits(q.scales).item() == bits(s).item()
        assert torch.equal(bits(q.data), bits(codes))
    assert sc.amax_history.tolist() == [0.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backends_give_the_same_bits(dtype: torch.dtype) -> None:
    if NATIVE_DISABLED:
        pytest.skip("MILES_QUANT_DISABLE_NATIVE=1")
    g = torch.Generator().manual_seed(3)
    a = mq.DelayedScaler("fp8_e4m3", history=4, backend="native")
    b = mq.DelayedScaler("fp8_e4m3", history=4, backend="torch")
    for step in range(7):
        x = (torch.randn(33, 70, generator=g) * 10.0 ** (step - 3)).to(dtype)
        qa, qb = a.quantize(x), b.quantize(x)
        assert torch.equal(bits(qa.data), bits(qb.data))
        assert torch.equal(bits(qa.scales), bits(qb.scales))


def test_a_non_finite_tensor_is_poisoned_and_not_recorded() -> None:
    sc = mq.DelayedScaler("fp8_e4m3", history=4)
    sc.quantize(_step(2.0))
    for bad in (float("nan"), float("inf")):
        x = _step(8.0).float()
        x[5] = bad
        q = sc.quantize(x)
        assert torch.isnan(q.scales)
        assert (q.data.view(torch.uint8) == 0x7F).all()
        assert torch.isnan(mq.dequantize(q)).all()
    assert sc.amax_history.tolist() == [2.0]
    q = sc.quantize(_step(1.0))  # still scaled by the last good history
    assert q.scales.item() == pytest.approx(2.0 / 448, rel=1e-6)


def test_state_dict_round_trip_continues_identically() -> None:
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(8, 40, generator=g) * (i + 1) for i in range(11)]
    a = mq.DelayedScaler("fp8_e5m2", history=4, margin=1)
    for x in xs[:6]:
        a.quantize(x)
    state = a.state_dict()
    assert state["num_recorded"] == 6
    assert isinstance(state["amax_history"], torch.Tensor)
    assert state["amax_history"].shape == (4,)
    b = mq.DelayedScaler("fp8_e5m2", history=4, margin=1)
    b.load_state_dict(state)
    assert torch.equal(b.amax_history, a.amax_history)
    for x in xs[6:]:
        qa, qb = a.quantize(x), b.quantize(x)
        assert torch.equal(bits(qa.data), bits(qb.data))
        assert torch.equal(bits(qa.scales), bits(qb.scales))
    # Through torch.save / torch.load (a checkpoint), too.
    import io

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    c = mq.DelayedScaler("fp8_e5m2", history=4, margin=1)
    c.load_state_dict(torch.load(buf))
    assert torch.equal(c.amax_history, a.amax_history)
    assert c.next_amax() == a.next_amax()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "mxfp4"}, "no per-tensor scale"),
        ({"history": 0}, "history must be"),
        ({"margin": -1}, "margin must be"),
        ({"backend": "cuda"}, "backend must be"),
    ],
)
def test_bad_settings_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mq.DelayedScaler(**kwargs)  # type: ignore[arg-type]


def test_bad_input_and_mismatched_state_raise() -> None:
    sc = mq.DelayedScaler(history=2)
    for x in (torch.ones(4, dtype=torch.float64), torch.tensor(1.0), [1.0]):
        with pytest.raises(ValueError, match="expected a float32"):
            sc.quantize(x)  # type: ignore[arg-type]
    state = mq.DelayedScaler(history=3).state_dict()
    with pytest.raises(ValueError, match="same settings"):
        sc.load_state_dict(state)
    bad = {**sc.state_dict(), "num_recorded": 5}
    with pytest.raises(ValueError, match="finite values"):
        sc.load_state_dict(bad)


@pytest.mark.parametrize("first", ["empty", "zeros"])
def test_an_empty_or_zero_history_falls_back_to_the_own_amax(first: str) -> None:
    # An MoE expert that no token reached sees empty activations: they record nothing, and a
    # history of zeros must not give the next real batch a 1e-10 amax (all values saturated).
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 3
    fresh = mq.DelayedScaler(history=4).quantize(x)  # first call: its own amax
    sc = mq.DelayedScaler(history=4)
    for _ in range(5):
        sc.quantize(torch.empty(0, 64) if first == "empty" else torch.zeros(2, 64))
    assert sc.state_dict()["num_recorded"] == (0 if first == "empty" else 5)
    assert sc.next_amax() is None
    q = sc.quantize(x)
    assert torch.equal(bits(q.scales), bits(fresh.scales))
    assert torch.equal(bits(q.data), bits(fresh.data))
    assert sc.next_amax() == x.abs().amax()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nvfp4_global_scale_comes_from_the_history(backend: str) -> None:
    sc = mq.DelayedScaler("nvfp4", history=2, backend=backend)  # type: ignore[arg-type]
    a, b, c = _step(2.0, 256), _step(8.0, 256), _step(1.0, 256)
    # Nothing recorded: the tensor's own amax, i.e. the dynamic result bit for bit.
    q0 = sc.quantize(a)
    dyn = mq.quantize(a, "nvfp4", backend=backend)  # type: ignore[arg-type]
    assert torch.equal(bits(q0.global_scale), bits(dyn.global_scale))
    assert torch.equal(q0.data, dyn.data)
    sc.quantize(b)  # scale from a (2.0); records 8.0
    q2 = sc.quantize(c)  # history [2, 8]: the scale of amax 8.0, not c's own 1.0
    want = torch.tensor(8.0, dtype=torch.float32) / 2688.0
    assert torch.equal(bits(q2.global_scale), bits(want))
    ref = mq.quantize(c, "nvfp4", global_scale=want, backend="torch")
    assert torch.equal(q2.data, ref.data)
    assert torch.equal(q2.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    assert sc.amax_history.tolist() == [8.0, 1.0]
    # A NaN poisons its block only and is not recorded.
    d = _step(4.0, 256)
    d[17] = float("nan")
    q3 = sc.quantize(d)
    s3 = q3.scales.view(torch.uint8)
    assert s3[1] == 0x7F
    assert (s3[torch.arange(16) != 1] != 0x7F).all()
    assert sc.amax_history.tolist() == [8.0, 1.0]
    # Values beyond the delayed range saturate: history max 8, x up to 64.
    q4 = sc.quantize(_step(64.0, 256))
    top = float(mq.dequantize(q4, torch.float32).abs().max())
    assert top == pytest.approx(float(q4.global_scale) * 2688, rel=1e-6)
    assert top < 64.0


def test_nvfp4_first_call_with_nan_is_the_dynamic_poisoned_result() -> None:
    sc = mq.DelayedScaler("nvfp4", history=4, backend="torch")
    x = _step(2.0, 64)
    x[0] = float("inf")
    q = sc.quantize(x)
    assert torch.isnan(q.global_scale)
    assert (q.scales.view(torch.uint8) == 0x7F).all()
    assert sc.amax_history.numel() == 0
