"""Qwen3-MoE in the embedded engine: exact logprobs, per-expert weight names, batch invariance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny_moe import build_qwen3_moe

from miles_rollout import Engine, EngineConfig, SamplingParams
from miles_transfer import tensor_digest

LOGPROB_TOL = 1e-5  # as for dense models (float32 rounding)


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 100 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def moe_hf(moe_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path) -> Iterator[Engine]:
    with EngineConfig(model_path=str(moe_dir), max_running_requests=8).build() as eng:
        yield eng


def _teacher(hf: Any, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    t = 1.0 if temperature == 0.0 else temperature
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return torch.log_softmax(logits / t, dim=-1)[pos, torch.tensor(output)]


def test_moe_logprobs_match_a_teacher_forced_transformers_forward(
    moe_engine: Engine, moe_hf: Any
) -> None:
    assert moe_engine.is_moe
    assert moe_engine.model_info()["num_experts_per_tok"] == 2
    params = [
        SamplingParams(temperature=t, max_new_tokens=10 + 5 * i, ignore_eos=True, seed=i)
        for i, t in enumerate([1.0, 0.7, 0.0, 1.2])
    ]
    futs = [moe_engine.submit(_prompt(4 + 9 * i, i), p) for i, p in enumerate(params)]
    worst = 0.0
    for i, (fut, p) in enumerate(zip(futs, params)):
        out = fut.result()
        assert out.completion_tokens == p.max_new_tokens
        assert out.routed_experts is None  # not asked for
        ref = _teacher(moe_hf, _prompt(4 + 9 * i, i), out.output_ids, p.temperature)
        worst = max(worst, (ref - torch.tensor(out.output_logprobs)).abs().max().item())
    assert worst < LOGPROB_TOL, f"max MoE logprob error {worst:.2e}"


def test_greedy_moe_matches_transformers_generate(moe_engine: Engine, moe_hf: Any) -> None:
    prompt = _prompt(11, 5)
    out = moe_engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=16))
    with torch.inference_mode():
        ref = moe_hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert out.output_ids == ref


def test_expert_weights_update_by_checkpoint_names_and_fused_names(moe_dir: Path) -> None:
    """Checkpoints (and SGLang, and trainers) name experts one by one; transformers fuses them.
    Updates and checksums take both; a full checksum reports the module's own names."""
    from transformers import AutoModelForCausalLM

    other = build_qwen3_moe(moe_dir.parent / "other", seed=1)
    ckpt = load_file(str(other / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in ckpt
    with EngineConfig(model_path=str(moe_dir)).build() as eng:
        eng.update_weights_from_disk(str(other), weight_version="per-expert")
        names = ["model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.0.mlp.gate.weight"]
        assert eng.weights_checksum(names) == {n: tensor_digest(ckpt[n]) for n in names}
        fused = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
        want = {n: tensor_digest(p) for n, p in fused.named_parameters(remove_duplicate=False)}
        assert eng.weights_checksum() == want
        # Fused names work as updates too (what miles_transfer pushes from an HF module).
        gate_up = "model.layers.0.mlp.experts.gate_up_proj"
        new = torch.randn(fused.get_parameter(gate_up).shape)
        eng.update_weights_from_tensor([(gate_up, new)], weight_version="fused")
        assert eng.weights_checksum([gate_up]) == {gate_up: tensor_digest(new)}
        inter = new.shape[1] // 2
        down_name = "model.layers.0.mlp.experts.7.gate_proj.weight"
        assert eng.weights_checksum([down_name]) == {down_name: tensor_digest(new[7, :inter])}
        out = eng.generate(_prompt(9), SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert out.weight_version == "fused"


def test_moe_cache_hits_and_batching_keep_logprobs_bit_identical(moe_dir: Path) -> None:
    """Expert GEMMs see a different set of tokens in every batch; row padding keeps each
    token's bits (float32 with the native kernels)."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=7)
    p1 = _prompt(20, 9)
    with (
        EngineConfig(model_path=str(moe_dir)).build() as cached,
        EngineConfig(model_path=str(moe_dir), enable_prefix_cache=False).build() as plain,
    ):
        turn1 = cached.generate(p1, params)
        p2 = p1 + turn1.output_ids + _prompt(6, 50)
        hit = cached.generate(p2, params, return_routed_experts=True)
        others = [plain.submit(_prompt(5 + 4 * k, k), params) for k in range(3)]
        miss = plain.generate(p2, params, return_routed_experts=True)
        for f in others:
            f.result()
        invariant = cached._runner.batch_invariant
    assert hit.cached_tokens == len(p1) + 11
    assert hit.output_ids == miss.output_ids
    assert hit.routed_experts is not None
    assert miss.routed_experts is not None
    # Routing of the cached prefix comes from the cache, and equals the recomputed one.
    assert torch.equal(hit.routed_experts, miss.routed_experts)
    if invariant:
        assert hit.output_logprobs == miss.output_logprobs
