"""Shared prefixes computed once (`ops.shared_prefix`) against the padded forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles_trainer.ops import attn_implementation, use_fast_ops
from miles_trainer.ops.shared_prefix import plan_shared_prefix

BF16 = torch.bfloat16


def test_plan_merges_tokens_whose_rows_agree_up_to_them() -> None:
    ids = torch.tensor([[1, 2, 3, 0], [1, 2, 4, 4], [1, 2, 3, 0], [5, 2, 3, 0]])
    owner, index = plan_shared_prefix(ids)
    # Distinct: 1, 12, 123, 1230 (rows 0 and 2), 124, 1244, 5, 52, 523, 5230.
    assert owner.tolist() == [0, 1, 2, 3, 6, 7, 12, 13, 14, 15]
    assert index.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 2, 3], [6, 7, 8, 9]]
    assert torch.equal(ids.view(-1)[owner][index], ids)


def test_plan_matches_the_definition_on_random_groups() -> None:
    """Against the definition, a dict of prefixes, on rows that share prompts and sometimes
    the start of their responses (a tiny vocabulary makes chance repeats)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 3, (int(n),), generator=g) for n in (4, 4, 6)]
    rows = [torch.cat([p, torch.randint(0, 3, (9 - len(p),), generator=g)]) for p in prompts * 4]
    ids = torch.stack(rows)[torch.randperm(12, generator=g)]
    owner, index = plan_shared_prefix(ids)
    seen: dict[tuple[int, ...], int] = {}
    want = [
        [seen.setdefault(tuple(row[: j + 1]), len(seen)) for j in range(9)] for row in ids.tolist()
    ]
    assert index.tolist() == want  # first-occurrence order is the dict's insertion order
    assert torch.equal(ids.view(-1)[owner][index], ids)


def _models(model_dir: Path, dtype: torch.dtype = BF16) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    attn = attn_implementation(dtype, torch.device("cpu"))
    shared, padded = (
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn)
        for _ in range(2)
    )
    assert use_fast_ops(shared)["shared_prefix"] == 1
    use_fast_ops(padded)
    del padded.model.forward  # the fused ops on the rows as they are
    return shared, padded


def _group_batch() -> torch.Tensor:
    """Two prompts x three samples, right-padded with 0 (a GRPO micro-batch)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for prompt_len in (5, 3):
        prompt = torch.randint(2, 60, (prompt_len,), generator=g)
        for resp_len in (6, 4, 6):
            resp = torch.randint(2, 60, (resp_len,), generator=g)
            rows.append(torch.cat([prompt, resp]))
    L = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, L - len(r))) for r in rows])


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_logits_are_the_padded_forwards_and_gradients_within_rounding(
    tiny_model_dir: Path, dtype: torch.dtype
) -> None:
    """bf16 (the GQA eager attention) and float32 (HF's SDPA): the logits bit for bit."""
    from transformers import AutoModelForCausalLM

    shared, padded = _models(tiny_model_dir, dtype)
    ids = _group_batch()
    dlogits = torch.randn(*ids.shape, shared.config.vocab_size, generator=torch.Generator())

    def run(model: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = model(input_ids=ids, use_cache=False).logits
        params = list(model.parameters())
        return logits.detach(), list(torch.autograd.grad(logits.float(), params, dlogits))

    got, got_grads = run(shared)
    want, want_grads = run(padded)
    assert torch.equal(got, want)  # bit for bit
    exact_model = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float64, attn_implementation="eager"
    )
    with torch.no_grad():  # float64 maths on the same bf16 weights
        for p, q in zip(exact_model.parameters(), shared.parameters()):
            p.copy_(q.double())
    exact = exact_model(input_ids=ids, use_cache=False).logits
    exact_grads = torch.autograd.grad(exact, list(exact_model.parameters()), dlogits.double())
    for g_got, g_want, g_exact in zip(got_grads, want_grads, exact_grads):
        scale = g_exact.abs().max().item()
        err_got = (g_got.double() - g_exact).abs().max().item() / scale
        err_want = (g_want.double() - g_exact).abs().max().item() / scale
        # bf16 end to end: both are 2-4% of the largest gradient (float32: ~1e-6); the summed
        # copies' gradients must not make it worse than the padded layout's.
        assert err_got < (5e-2 if dtype == BF16 else 1e-5), err_got
        assert err_got <= 1.5 * err_want + (2e-3 if dtype == BF16 else 1e-7), (err_got, err_want)


def test_packed_rows_hooks_and_caches_take_hfs_forward(tiny_model_dir: Path) -> None:
    shared, _ = _models(tiny_model_dir)
    ids = _group_batch()
    calls: list[int] = []
    real = shared.model.layers[0].forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    shared.model.layers[0].forward = spy  # HF's decoder loop calls each layer's forward
    with torch.no_grad():
        shared(input_ids=ids, use_cache=False)
        assert calls == []  # shared: the layers' modules are used, not their forwards
        packed = torch.cat([torch.arange(5), torch.arange(4)])[None]  # positions restart
        shared(input_ids=ids[:1, :9], position_ids=packed, use_cache=False)
        assert len(calls) == 1
        handle = shared.model.norm.register_forward_hook(lambda *a: None)
        shared(input_ids=ids, use_cache=False)
        assert len(calls) == 2
        handle.remove()
        out = shared(input_ids=ids, use_cache=True)
        assert len(calls) == 3
        assert out.past_key_values is not None
