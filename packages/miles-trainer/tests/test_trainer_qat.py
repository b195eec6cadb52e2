"""INT4 QAT in the trainer (TrainerConfig.qat, through miles-quant): a train step runs on the
fake-quantized MoE experts, and the compressed-tensors export has the codes it trained with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _trainer_qat_worker import qat_config
from _trainer_testlib import make_batch

from miles_trainer import FSDPTrainer, QATConfig, TrainerConfig

mq = pytest.importorskip("miles_quant", reason="QAT needs miles-quant (miles-trainer[quant])")

VOCAB = 61
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen3-MoE (4 experts, dims multiples of 128), saved in float32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("tiny-moe") / "model"
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def test_qat_config_validation() -> None:
    assert QATConfig().patterns == ("*.experts.*",)
    with pytest.raises(ValueError, match="group must be 32 or 128"):
        QATConfig(group=64)
    with pytest.raises(ValueError, match="non-empty tuple of patterns"):
        QATConfig(patterns="*.experts.*")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty tuple of patterns"):
        QATConfig(patterns=())


def test_missing_miles_quant_names_the_install(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "miles_quant.qat", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install miles-quant"):
        FSDPTrainer(TrainerConfig(model_path=str(moe_dir), qat=QATConfig()))


def test_no_match_is_a_clear_error(moe_dir: Path) -> None:
    with pytest.raises(ValueError, match="no parameter matches"):
        FSDPTrainer(TrainerConfig(model_path=str(moe_dir), qat=QATConfig(patterns=("*.nope",))))


def test_qat_train_step_and_export_codes(moe_dir: Path, tmp_path: Path) -> None:
    from miles_quant.checkpoint import export_checkpoint, load_quantized
    from miles_quant.qat import fake_quantize_int4

    cfg = TrainerConfig(
        model_path=str(moe_dir), dtype="bfloat16", lr=1e-3, micro_batch_size=4, qat=QATConfig()
    )
    trainer = FSDPTrainer(cfg)
    experts = {n: p for n, p in trainer.model.named_parameters() if ".experts." in n}
    assert len(experts) == 4  # fused gate_up_proj and down_proj in 2 layers
    before = {n: p.detach().clone() for n, p in experts.items()}
    batch = make_batch(8, seed=1)
    # The forward computes with fake-quantized experts: logprobs differ from the plain model's.
    qat_logp = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    metrics = trainer.train_step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["grad_norm"] > 0
    assert all(not torch.equal(before[n], p) for n, p in experts.items())  # experts trained

    plain = FSDPTrainer(TrainerConfig(model_path=str(moe_dir), dtype="bfloat16"))
    plain_logp = plain.compute_logprobs(batch.tokens, batch.response_lengths)
    assert qat_logp != plain_logp

    ckpt = tmp_path / "step1"
    trainer.save_hf_checkpoint(ckpt, dtype="bfloat16")  # the compute dtype: same bf16 weights
    out = tmp_path / "w4a16"
    export_checkpoint(ckpt, out, "int4_g128", only=list(cfg.qat.patterns))  # type: ignore[union-attr]
    state = load_quantized(out, dequantize=False)
    checked = 0
    for name, p in experts.items():
        w = p.detach().to(torch.bfloat16)  # the bf16 copy the QAT forward quantized
        fq = fake_quantize_int4(w)  # what that forward computed with
        prefix, _, leaf = name.rpartition(".")
        half = w.shape[1] // 2
        for e in range(w.shape[0]):
            # The checkpoint has the per-expert names engines load (gate rows first).
            if leaf == "down_proj":
                pieces = {"down_proj": slice(None)}
            else:
                pieces = {"gate_proj": slice(0, half), "up_proj": slice(half, None)}
            for part, rows in pieces.items():
                q = state[f"{prefix}.{e}.{part}.weight"]
                assert isinstance(q, mq.QuantizedTensor), name
                assert torch.equal(q.data, mq.quantize(w[e, rows], "int4_g128").data), name
                assert q.scales.dtype == torch.bfloat16
                deq = mq.dequantize(q, torch.bfloat16).view(torch.int16)
                assert torch.equal(deq, fq[e, rows].contiguous().view(torch.int16)), name
                checked += 1
    assert checked == 2 * 4 * 3  # layers x experts x (gate, up, down)


def test_qat_on_two_fsdp2_ranks_matches_one_rank(moe_dir: Path, tmp_path: Path) -> None:
    """Under FSDP2 the hooks see the unsharded bf16 parameters: the same fake-quantized forward
    as one rank. (Parameters after an Adam step are not compared: on this MoE they differ by up
    to ~lr between 1 and 2 ranks with or without QAT, Adam's first step amplifying bf16
    reduction-order noise in near-zero gradients; see the README's tolerance notes.)"""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(HERE / "_trainer_qat_worker.py"), str(moe_dir), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    batch = make_batch(8, seed=1)

    def run(qat: bool) -> tuple[torch.Tensor, dict[str, float]]:
        trainer = FSDPTrainer(qat_config(str(moe_dir), qat))
        logp = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
        return torch.tensor([x for row in logp for x in row]), trainer.train_step(batch)

    (one, one_metrics), (plain, _) = run(True), run(False)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["world_size"] == 2
        two = torch.tensor([x for row in record["logprobs"] for x in row])
        diff = float((two - one).abs().max())
        qat_effect = float((plain - one).abs().max())
        print(
            f"rank {rank}: max |logprob diff| QAT 1 vs 2 ranks {diff:.3g}, QAT vs plain "
            f"{qat_effect:.3g}"
        )
        assert torch.equal(two, one)  # measured: bit-identical (diff 0)
        assert qat_effect > 1e-2  # the fake quantization is in the 2-rank forward too
        for key in ("loss", "entropy", "grad_norm"):
            assert record["metrics"][key] == pytest.approx(one_metrics[key], rel=1e-4), key
