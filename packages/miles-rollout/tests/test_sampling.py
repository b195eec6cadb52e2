"""SamplingParams validation and the batched sampler's exact distributions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_rollout import SamplingParams
from miles_rollout._sampling import BatchSampler, uniform


def test_from_dict_names_unknown_keys_and_accepts_sglang_names() -> None:
    with pytest.raises(ValueError, match=r"unknown sampling_params keys: \['bogus', 'topk'\]"):
        SamplingParams.from_dict({"topk": 3, "bogus": 1, "top_p": 0.5})
    p = SamplingParams.from_dict(
        {"sampling_seed": 5, "stop": "x", "max_new_tokens": None, "top_k": None, "n": 1}
    )
    assert p.seed == 5
    assert p.stop == ["x"]
    assert p.max_new_tokens is None
    assert p.top_k == -1
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.2"):
        SamplingParams.from_dict({"repetition_penalty": 1.2})
    with pytest.raises(ValueError, match="twice"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})
    assert SamplingParams.from_dict(None) == SamplingParams()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_to_dict_round_trip_uses_sglang_names() -> None:
    p = SamplingParams(temperature=0.5, top_k=4, seed=9, stop_token_ids=[3])
    d = p.to_dict()
    assert d == {"temperature": 0.5, "top_k": 4, "sampling_seed": 9, "stop_token_ids": [3]}
    assert SamplingParams.from_dict(d) == p


def test_uniform_is_a_deterministic_stream_in_unit_interval() -> None:
    xs = [uniform(42, i) for i in range(20000)]
    assert xs == [uniform(42, i) for i in range(20000)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert abs(sum(xs) / len(xs) - 0.5) < 0.01
    assert xs[:5] != [uniform(43, i) for i in range(5)]


def _frequencies(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Sample with a regular grid of n uniforms: the frequencies are the distribution to 1/n."""
    sampler = BatchSampler([params] * n, logits.shape[-1])
    tokens, _ = sampler.sample(logits.expand(n, -1).contiguous(), [(i + 0.5) / n for i in range(n)])
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / n


def test_sampler_distributions_are_exact() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    n = 20000
    for params in [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]:
        probs = torch.softmax(logits[0].double() / params.temperature, -1)
        order = probs.argsort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        mass = 0.0
        for rank, tok in enumerate(order.tolist()):
            if params.top_k != -1 and rank >= params.top_k:
                break
            if mass > params.top_p:  # SGLang: keep a token while the mass before it <= top_p
                break
            if probs[tok] < params.min_p * probs[order[0]]:
                break
            keep[tok] = True
            mass += float(probs[tok])
        expected = torch.where(keep, probs, 0.0)
        expected /= expected.sum()
        got = _frequencies(params, logits, n)
        assert (got - expected).abs().max() < 2.0 / n, params


def test_sampler_logprobs_ignore_truncation_and_greedy_uses_temperature_one() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 10)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=2),
        SamplingParams(temperature=2.0, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    tokens, logprobs = BatchSampler(params, 10).sample(logits, [0.3, 0.7, 0.9, 0.1])
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0])[:, None]
    ref = torch.log_softmax(logits / temps, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(logprobs, ref)
    assert tokens[0] == logits[0].argmax()
    assert tokens[3] == logits[3].argmax()
    assert tokens[1] in logits[1].topk(2).indices


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-30, 30), min_size=2, max_size=40),
    st.floats(0.0, 0.999999),
    st.floats(0.05, 3.0),
)
def test_sampler_never_picks_a_zero_probability_token(
    values: list[float], u: float, temperature: float
) -> None:
    logits = torch.tensor([values], dtype=torch.float32)
    logits[0, 0] = -math.inf  # masked token
    params = SamplingParams(temperature=temperature, top_p=0.9)
    for p in (params, SamplingParams(temperature=temperature)):
        token, logprob = BatchSampler([p], logits.shape[1]).sample(logits, [u])
        assert token.item() != 0
        assert math.isfinite(logprob.item())
