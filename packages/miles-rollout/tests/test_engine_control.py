"""Engine control: pause modes, weight updates (all or nothing), checksums, shutdown."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_rollout import Engine, EngineConfig, GenerateOutput, SamplingParams
from miles_transfer import WeightReceiver, tensor_digest

Teacher = Callable[[list[int], list[int], float], list[float]]
LOGPROB_TOL = 1e-5
PROMPTS = [[5, 9, 11, 40], [7, 7, 8], [30, 31, 32, 33, 34, 35, 36]]


def _state(engine: Engine) -> dict[str, int]:
    state = engine.server_info()["internal_states"][0]
    return {"running": state["num_running_reqs"], "waiting": state["num_waiting_reqs"]}


def _wait_running(engine: Engine, n: int) -> None:
    deadline = time.monotonic() + 20
    while _state(engine)["running"] < n:
        assert time.monotonic() < deadline, _state(engine)
        time.sleep(0.002)


def _submit_long(engine: Engine, max_new: int = 90) -> list[Future[GenerateOutput]]:
    return [
        engine.submit(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True, seed=10 + i))
        for i, p in enumerate(PROMPTS)
    ]


def test_pause_abort_returns_partial_outputs(fresh_engine: Engine) -> None:
    futs = _submit_long(fresh_engine)
    _wait_running(fresh_engine, len(futs))
    fresh_engine.pause_generation("abort")
    for f in futs:
        out = f.result(timeout=5)
        assert out.finish_reason.type == "abort"
        assert 1 <= out.completion_tokens < 90
        assert out.output_logprobs is not None
        assert len(out.output_logprobs) == out.completion_tokens
    # Paused: a new request waits until continue_generation.
    later = fresh_engine.submit([1, 2, 3], SamplingParams(max_new_tokens=3))
    time.sleep(0.2)
    assert not later.done()
    fresh_engine.continue_generation()
    assert later.result(timeout=10).completion_tokens == 3


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_resumes_with_same_tokens_and_exact_logprobs(
    fresh_engine: Engine, mode: str, teacher_logprobs: Teacher
) -> None:
    reference = [f.result() for f in _submit_long(fresh_engine)]
    futs = _submit_long(fresh_engine)
    _wait_running(fresh_engine, len(futs))
    fresh_engine.pause_generation(mode)
    state = _state(fresh_engine)
    if mode == "retract":
        assert state["running"] == 0
        assert state["waiting"] == len(futs)
    else:
        assert state["running"] == len(futs)
    time.sleep(0.1)
    assert not any(f.done() for f in futs)
    fresh_engine.continue_generation()
    for prompt, fut, ref in zip(PROMPTS, futs, reference):
        out = fut.result(timeout=30)
        assert out.finish_reason.type == "length"
        # Counter-based sampling: a paused request continues its random stream exactly.
        assert out.output_ids == ref.output_ids
        assert out.output_logprobs is not None
        expected = teacher_logprobs(prompt, out.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, expected)) < LOGPROB_TOL


def test_update_weights_from_tensor_then_checksums_match(
    fresh_engine: Engine, model_dir_v2: Path
) -> None:
    assert isinstance(fresh_engine, WeightReceiver)
    new = load_file(str(model_dir_v2 / "model.safetensors"))
    before = fresh_engine.weights_checksum()
    fresh_engine.update_weights_from_tensor(new.items(), weight_version="7")
    after = fresh_engine.weights_checksum(list(new))
    assert after == {name: tensor_digest(t.to(fresh_engine.dtype)) for name, t in new.items()}
    assert fresh_engine.weight_version == "7"
    # The tied output embedding is the same tensor as the input embedding.
    assert fresh_engine.weights_checksum(["lm_head.weight"])["lm_head.weight"] == tensor_digest(
        new["model.embed_tokens.weight"]
    )
    assert after != {k: before[k] for k in after}
    # Generation uses the new weights (the fused projections were rebuilt).
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    out = fresh_engine.generate(PROMPTS[0], greedy)
    assert out.weight_version == "7"
    with EngineConfig(model_path=str(model_dir_v2)).build() as v2:
        assert v2.generate(PROMPTS[0], greedy).output_ids == out.output_ids


def test_update_in_buckets_rebuilds_the_fused_weights_once(
    fresh_engine: Engine, model_dir_v2: Path
) -> None:
    runner = fresh_engine._runner
    rebuilds: list[int] = []
    original = runner.refresh_weights

    def counting() -> None:
        rebuilds.append(1)
        original()

    runner.refresh_weights = counting  # type: ignore[method-assign]
    items = list(load_file(str(model_dir_v2 / "model.safetensors")).items())
    for i in range(3):  # three buckets, as push_module_weights sends them
        fresh_engine.update_weights_from_tensor(items[i::3], weight_version="b")
    assert rebuilds == []
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    out = fresh_engine.generate(PROMPTS[0], greedy)
    assert rebuilds == [1]
    with EngineConfig(model_path=str(model_dir_v2)).build() as v2:
        assert v2.generate(PROMPTS[0], greedy).output_ids == out.output_ids


def test_tied_embedding_accepts_either_name(fresh_engine: Engine) -> None:
    emb = torch.randn(128, 64)
    fresh_engine.update_weights_from_tensor([("lm_head.weight", emb)])
    sums = fresh_engine.weights_checksum(["model.embed_tokens.weight", "lm_head.weight"])
    assert set(sums.values()) == {tensor_digest(emb)}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64)), "unknown parameter names"),
        (("model.norm.weight", torch.zeros(65)), r"shape \(65,\) != \(64,\)"),
        (("model.norm.weight", torch.zeros(64, dtype=torch.int32)), "not a floating-point"),
    ],
)
def test_bad_update_changes_nothing(
    fresh_engine: Engine, bad: tuple[str, torch.Tensor], message: str
) -> None:
    before = fresh_engine.weights_checksum()
    good = ("model.layers.0.mlp.down_proj.weight", torch.ones(64, 128))
    with pytest.raises(ValueError, match=message):
        fresh_engine.update_weights_from_tensor([good, bad], weight_version="bad")
    assert fresh_engine.weights_checksum() == before
    assert fresh_engine.weight_version == "0"
    assert fresh_engine.generate([1, 2], SamplingParams(max_new_tokens=2)).completion_tokens == 2


def test_update_weights_from_disk_and_while_paused(
    fresh_engine: Engine, model_dir_v2: Path
) -> None:
    futs = _submit_long(fresh_engine, max_new=60)
    _wait_running(fresh_engine, len(futs))
    fresh_engine.pause_generation("in_place")
    fresh_engine.update_weights_from_disk(str(model_dir_v2), weight_version="v2")
    assert fresh_engine.model_path == str(model_dir_v2.resolve())
    fresh_engine.continue_generation()
    assert all(f.result(timeout=30).weight_version == "v2" for f in futs)
    with EngineConfig(model_path=str(model_dir_v2)).build() as v2:
        assert fresh_engine.weights_checksum() == v2.weights_checksum()
    with pytest.raises(ValueError, match="does not exist"):
        fresh_engine.update_weights_from_disk("/nonexistent/ckpt")
    assert fresh_engine.weight_version == "v2"


def test_bf16_engine_casts_updates(model_dir: Path) -> None:
    with EngineConfig(model_path=str(model_dir), dtype="bfloat16").build() as eng:
        t = torch.randn(64)
        eng.update_weights_from_tensor([("model.norm.weight", t)])
        got = eng.weights_checksum(["model.norm.weight"])["model.norm.weight"]
        assert got == tensor_digest(t.to(torch.bfloat16))


def test_checksum_names_and_flush_cache(fresh_engine: Engine) -> None:
    with pytest.raises(ValueError, match="unknown parameter names"):
        fresh_engine.weights_checksum(["nope"])
    assert "model.embed_tokens.weight" in fresh_engine.weights_checksum()
    assert fresh_engine.flush_cache() is True
    futs = _submit_long(fresh_engine)
    _wait_running(fresh_engine, len(futs))
    fresh_engine.pause_generation("in_place")
    assert fresh_engine.flush_cache() is False  # requests in flight, as in SGLang
    fresh_engine.continue_generation()
    for f in futs:
        f.result(timeout=30)
    assert fresh_engine.flush_cache() is True


def test_update_weight_version_and_abort_request(fresh_engine: Engine) -> None:
    fresh_engine.update_weight_version("42")
    assert fresh_engine.server_info()["weight_version"] == "42"
    fut = fresh_engine.submit([1, 2], SamplingParams(max_new_tokens=100, ignore_eos=True), rid="r")
    _wait_running(fresh_engine, 1)
    assert fresh_engine.abort_request("r") == 1
    out = fut.result(timeout=5)
    assert out.finish_reason.type == "abort"
    assert out.weight_version == "42"
    assert fresh_engine.abort_request("r") == 0


def test_each_output_token_reports_the_weight_version_that_made_it(fresh_engine: Engine) -> None:
    """A request in flight across an update has tokens from both versions, in order."""
    (fut,) = _submit_long(fresh_engine)[:1]
    _wait_running(fresh_engine, 1)
    fresh_engine.pause_generation("in_place")
    try:
        norm = fresh_engine.weights_checksum(["model.norm.weight"])
        fresh_engine.update_weights_from_tensor(
            [("model.norm.weight", torch.full((64,), 1.5))], weight_version="1"
        )
        assert fresh_engine.weights_checksum(["model.norm.weight"]) != norm
    finally:
        fresh_engine.continue_generation()
    out = fut.result(timeout=30)
    versions = out.output_weight_versions
    assert versions is not None
    assert len(versions) == out.completion_tokens == 90
    k = versions.count("0")
    assert 1 <= k < 90
    assert versions == ["0"] * k + ["1"] * (90 - k)
    assert out.weight_version == "1"


@pytest.mark.parametrize("endpoint", ["/update_weight_version", "/update_weights_from_tensor"])
def test_updates_over_http_abort_requests_only_when_asked(
    fresh_engine: Engine, endpoint: str
) -> None:
    """SGLang's /update_weight_version aborts everything by default; ours never unless asked."""
    import asyncio

    import aiohttp

    from miles_rollout import serve
    from miles_transfer.push.safe_wire import SAFE_FORMAT, discard_safe, write_safe

    def body(version: str, abort: bool | None) -> dict[str, object]:
        if endpoint == "/update_weight_version":
            out: dict[str, object] = {"new_version": version}
        else:
            # The server's default wire: a safetensors file named in the request (no pickle).
            norm = [("model.norm.weight", torch.full((64,), 1.25))]
            out = {"serialized_named_tensors": [write_safe(norm)], "load_format": SAFE_FORMAT}
            out["weight_version"] = version
        if abort is not None:
            out["abort_all_requests"] = abort
        return out

    async def update(url: str, payload: dict[str, object]) -> int:
        try:
            async with aiohttp.ClientSession() as s, s.post(url + endpoint, json=payload) as r:
                return r.status
        finally:
            for p in payload.get("serialized_named_tensors", []):  # type: ignore[attr-defined]
                discard_safe(p)  # the sender owns the file

    with serve(fresh_engine) as handle:
        long = SamplingParams(max_new_tokens=40, ignore_eos=True, seed=3)
        for version, abort in (("1", None), ("2", False), ("3", True)):
            fut = fresh_engine.submit(PROMPTS[0], long)
            _wait_running(fresh_engine, 1)
            fresh_engine.pause_generation("in_place")  # so the update lands mid-request
            assert asyncio.run(update(handle.url, body(version, abort))) == 200
            fresh_engine.continue_generation()
            out = fut.result(timeout=30)
            if abort:
                assert out.finish_reason.type == "abort"
                assert out.completion_tokens < 40
            else:
                assert out.finish_reason.type == "length"
                assert out.completion_tokens == 40
                assert (out.output_weight_versions or [])[-1] == version
            assert fresh_engine.weight_version == version


def test_shutdown_aborts_in_flight_requests(model_dir: Path) -> None:
    eng = EngineConfig(model_path=str(model_dir)).build()
    futs = _submit_long(eng)
    eng.shutdown()
    assert all(f.result(timeout=5).finish_reason.type == "abort" for f in futs)
    assert not eng.health()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit([1, 2])
    eng.shutdown()  # idempotent


def test_miles_transfer_push_verifies_against_the_engine(
    fresh_engine: Engine, model_dir_v2: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from miles_transfer import push_module_weights

    trained = AutoModelForCausalLM.from_pretrained(model_dir_v2, dtype=torch.float32)
    report = push_module_weights(trained, fresh_engine, weight_version="11", bucket_bytes=1 << 16)
    assert report is not None
    assert report.verified
    assert report.buckets > 1
    assert fresh_engine.weight_version == "11"
    assert fresh_engine.weights_checksum() == {
        n: tensor_digest(p) for n, p in trained.named_parameters(remove_duplicate=False)
    }


def test_failed_prefill_fails_the_requests_instead_of_hanging(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with EngineConfig(model_path=str(model_dir)).build() as eng:

        def broken_prefill(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("injected prefill failure")

        monkeypatch.setattr(eng._runner, "prefill", broken_prefill)
        futs = [eng.submit(p, SamplingParams(max_new_tokens=3)) for p in PROMPTS]
        for fut in futs:
            with pytest.raises(RuntimeError, match="injected prefill failure"):
                fut.result(timeout=60)
        monkeypatch.undo()
        # The engine keeps serving once the fault is gone.
        out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert out.completion_tokens == 2
