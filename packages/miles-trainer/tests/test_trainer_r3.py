"""R3 (rollout routing replay) on the FSDP2 backend with a tiny HF Qwen3-MoE.

The rollout is a plain transformers forward under the rollout weights (``output_router_logits``:
softmax, top-k of the router's own scores), independent of miles_trainer's router patch. The
trainer runs on weights that drifted from them (2% noise), so its routers disagree with the
rollout's on some tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _megatron_testlib import save_tiny, tiny_moe_config
from _r3_testlib import LAYERS, TOP_K, make_drifted, rollout_batch

from miles_trainer import FSDPTrainer, TrainBatch, TrainerConfig
from miles_trainer.batch import make_micro_batch
from miles_trainer.r3 import RoutingReplay, install_hf


@pytest.fixture(scope="module")
def rollout_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tiny_moe_config(), tmp_path_factory.mktemp("r3") / "rollout")


@pytest.fixture(scope="module")
def drifted_dir(rollout_dir: Path) -> Path:
    return make_drifted(rollout_dir, rollout_dir.parent / "drifted")


def test_batch_carries_routed_experts_aligned() -> None:
    class S:  # a graded rollout sample with SGLang-shaped, read-only routed experts
        def __init__(self, toks: list[int], r: int, routed: Any) -> None:
            self.tokens, self.response_length, self.reward = toks, r, 1.0
            self.loss_mask, self.rollout_logprobs = [1] * r, [-1.0] * r
            self.group_index, self.index, self.routed_experts = 0, 0, routed

    gen = np.random.default_rng(0)
    rows = [gen.integers(0, 4, (n - 1, LAYERS, TOP_K)).astype(np.int32) for n in (5, 3)]
    for r in rows:
        r.flags.writeable = False
    batch = TrainBatch.from_samples([S([1, 2, 3, 4, 5], 2, rows[0]), S([6, 7, 8], 1, None)])
    assert batch.routed_experts is not None
    assert batch.routed_experts[1] is None
    assert batch.routed_experts[0].dtype == torch.int32
    assert batch.select([1, 0]).routed_experts[1] is batch.routed_experts[0]  # type: ignore[index]
    full = TrainBatch.from_samples([S([1, 2, 3, 4, 5], 2, rows[0]), S([6, 7, 8], 1, rows[1])])
    for packed in (False, True):
        mb = make_micro_batch(full, [1, 0], torch.device("cpu"), packed=packed)
        assert mb.routed_BLNK is not None
        flat = mb.routed_BLNK.reshape(-1, LAYERS, TOP_K)
        starts = [0, 3] if packed else [0, 5]  # sample 1 first (3 tokens), then sample 0
        for start, i in zip(starts, [1, 0]):
            n = len(full.tokens[i])
            assert torch.equal(flat[start : start + n - 1], torch.tensor(rows[i]))
            assert bool((flat[start + n - 1] == -1).all())  # the last token has no record
        if not packed:
            assert bool((flat[3:5] == -1).all())  # padding of sample 1's row
    with pytest.raises(ValueError, match=r"sample 1.*routed_experts\[1\] has shape \(1, 2, 2\)"):
        TrainBatch(**{**_fields(full), "routed_experts": [rows[0], rows[0][:1]]})
    with pytest.raises(ValueError, match=r"sample 1.*\[num_layers, top_k\] = \[2, 1\]"):
        TrainBatch(**{**_fields(full), "routed_experts": [rows[0], rows[1][:, :, :1]]})
    with pytest.raises(ValueError, match="an expert id below -1"):
        TrainBatch(**{**_fields(full), "routed_experts": [rows[0] * 0 - 2, None]})
    half = rows[0].copy()
    half[0, 0, 0] = -1
    with pytest.raises(ValueError, match="a row with both expert ids and -1"):
        TrainBatch(**{**_fields(full), "routed_experts": [half, None]})
    TrainBatch(**{**_fields(full), "routed_experts": [rows[0] * 0 - 1, None]})  # dense layers


def _fields(batch: TrainBatch) -> dict[str, Any]:
    return {k: getattr(batch, k) for k in ("tokens", "response_lengths", "loss_masks")} | {
        "rollout_logprobs": batch.rollout_logprobs,
        "rewards": batch.rewards,
    }


def test_replayed_moe_block_is_the_manual_moe(drifted_dir: Path) -> None:
    """A patched Qwen3-MoE block under a record computes sum_k p_k expert_{e_k}(h) with the
    recorded e and p the router's softmax renormalised over them; the router's gradient is
    that formula's. Without a record it computes HF's own bits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(drifted_dir, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(drifted_dir, dtype=torch.float32).eval()
    replay = RoutingReplay(replay=True, num_layers=LAYERS, top_k=TOP_K, num_experts=4)
    assert install_hf(model, replay) == LAYERS
    ids = torch.tensor([[3, 14, 15, 9, 26, 53, 58, 9]])
    assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)

    block = model.model.layers[1].mlp
    h_TH = torch.randn(8, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    rec_TK = torch.stack([torch.randperm(4, generator=gen)[:TOP_K] for _ in range(8)])
    rec_TNK = torch.stack([rec_TK, rec_TK], dim=1)
    g_TH = torch.randn(8, 64, generator=gen)
    with replay.record(rec_TNK, count=True):
        out_TH = block(h_TH[None])[0]
    (out_TH * g_TH).sum().backward()
    assert replay.metrics(torch.device("cpu"))["r3_expert_match"] == 1.0
    got_grad = block.gate.weight.grad.clone()

    w = block.gate.weight.detach().clone().requires_grad_(True)
    p_TK = torch.softmax(h_TH.detach() @ w.T, -1).gather(-1, rec_TK)
    p_TK = p_TK / p_TK.sum(-1, keepdim=True)
    ex = block.experts
    want_TH = torch.zeros(8, 64)
    for t in range(8):
        for k in range(TOP_K):
            e = int(rec_TK[t, k])
            gate, up = (h_TH[t].detach() @ ex.gate_up_proj[e].detach().T).chunk(2)
            y = (torch.nn.functional.silu(gate) * up) @ ex.down_proj[e].detach().T
            want_TH[t] += p_TK[t, k] * y
    (want_TH * g_TH).sum().backward()
    torch.testing.assert_close(out_TH.detach(), want_TH.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, w.grad, rtol=1e-4, atol=1e-5)  # measured 1.5e-6
    assert float(got_grad.abs().sum()) > 0


def _trainer(model_dir: Path, *, r3: bool, packing: bool = False) -> FSDPTrainer:
    cfg = TrainerConfig(model_path=str(model_dir), r3=r3, lr=1e-3, packing=packing)
    return FSDPTrainer(cfg)


def test_replay_uses_the_rollout_experts_and_closes_the_gap(
    rollout_dir: Path, drifted_dir: Path
) -> None:
    batch = rollout_batch(rollout_dir)
    used: list[torch.Tensor] = []

    def capture(module: Any, args: tuple[Any, ...]) -> None:
        used.append(args[1].detach().clone())  # Qwen3MoeExperts(hidden, top_k_index, weights)

    replayed = _trainer(drifted_dir, r3=True)
    layers: Any = replayed.model.model.layers  # type: ignore[union-attr]
    hooks = [layer.mlp.experts.register_forward_pre_hook(capture) for layer in layers]
    with_r3 = replayed.train_step(batch)
    for h in hooks:
        h.remove()
    # Every recorded (token, layer) of the training forward used the rollout's experts.
    mb = make_micro_batch(batch, list(range(len(batch))), torch.device("cpu"))
    assert mb.routed_BLNK is not None
    rec_TNK = mb.routed_BLNK.reshape(-1, LAYERS, TOP_K).long()
    has_T = rec_TNK[:, 0, 0] >= 0
    assert len(used) == LAYERS
    assert int(has_T.sum()) == sum(len(t) - 1 for t in batch.tokens)
    for layer, idx_TK in enumerate(used):
        assert torch.equal(idx_TK[has_T], rec_TNK[has_T, layer])
    assert with_r3["r3_expert_match"] == 1.0
    assert with_r3["r3_router_agreement"] < 0.99  # the drifted routers disagree

    without = _trainer(drifted_dir, r3=False).train_step(batch)
    assert without["r3_expert_match"] == without["r3_router_agreement"] < 0.99
    gap_r3 = with_r3["train_rollout_logprob_abs_diff"]
    gap = without["train_rollout_logprob_abs_diff"]
    assert gap_r3 < 0.8 * gap, (gap_r3, gap)  # measured 0.112 vs 0.179

    # The same replay through packed micro-batches (alignment kept through packing).
    packed = _trainer(drifted_dir, r3=True, packing=True).train_step(batch)
    assert packed["r3_expert_match"] == 1.0
    assert packed["train_rollout_logprob_abs_diff"] == pytest.approx(gap_r3, rel=1e-5)

    # Under the rollout's own weights the trainer reproduces the rollout exactly, r3 or not.
    same = _trainer(rollout_dir, r3=True).train_step(batch)
    assert same["r3_router_agreement"] == 1.0
    assert same["train_rollout_logprob_abs_diff"] < 1e-6


def test_r3_refuses_what_it_cannot_replay(
    rollout_dir: Path, drifted_dir: Path, tiny_model_dir: Path
) -> None:
    with pytest.raises(ValueError, match=r"trainer\.r3 needs an MoE model"):
        _trainer(tiny_model_dir, r3=True)
    trainer = _trainer(drifted_dir, r3=True)
    with pytest.raises(ValueError, match=r"trainer.r3 is on but sample 0 .*no routed_experts"):
        trainer.train_step(rollout_batch(rollout_dir, with_routing=False))
    batch = rollout_batch(rollout_dir)
    assert batch.routed_experts is not None
    bad = [t[:, :1] for t in batch.routed_experts]  # a one-layer model's record
    with pytest.raises(ValueError, match=r"the model has \[2, 2\]: the record comes from another"):
        trainer.train_step(TrainBatch(**{**_fields(batch), "routed_experts": bad}))
    bad = [t + 4 for t in batch.routed_experts]
    with pytest.raises(ValueError, match="expert id 7, the model has 4 experts"):
        trainer.train_step(TrainBatch(**{**_fields(batch), "routed_experts": bad}))
