"""miles-trainer's R3 routing replay and checkpoint/resume on one GPU, both backends.

Why: the CPU tests cover both features on gloo; this runs them on CUDA, where the kernels are
nondeterministic unless asked (``TrainerConfig.deterministic``: ``use_deterministic_algorithms``
and ``CUBLAS_WORKSPACE_CONFIG``), where the MoE experts' ``index_add_`` and megatron's routing
have other implementations, and where DCP writes from an NCCL group. Each step prints PASS or
FAIL; the exit status is the number of FAILs. About a minute on an H100.

    bash tools/gpu_checks/trainer_r3_resume_check.sh          # sets up megatron-core if needed
    python tools/gpu_checks/trainer_r3_resume_check.py --cpu  # the same steps on the CPU path

For a tiny Qwen3-MoE (rollout weights, and trainer weights drifted 2% from them), per backend
(FSDP2 on one rank, Megatron TP 1), in bf16 and fp32 compute:
1. R3: a rollout batch recorded by transformers under the rollout weights; with replay every
   recorded row uses the rollout's experts (``r3_expert_match`` 1.0) and the train/rollout
   logprob gap is smaller than without;
2. resume: 3 steps uninterrupted vs 1 step, ``save_checkpoint``, a fresh trainer
   ``load_checkpoint`` and 2 more steps: the same metrics and weights, bit for bit
   (``deterministic: true``);
3. ``export_hf`` of the checkpoint equals ``save_hf_checkpoint`` of the trainer that wrote it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

FAILS = 0
VOCAB = 128
LAYERS = 2
TOP_K = 2


def step(name: str, ok: bool, detail: str = "") -> None:
    global FAILS
    FAILS += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def make_models(root: Path) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(root / "rollout")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.std())
    model.save_pretrained(root / "drifted")
    return root / "rollout", root / "drifted"


def rollout_batch(model_dir: Path, device: torch.device) -> Any:
    """16 samples: transformers' own top-k experts and logprobs under the rollout weights."""
    from transformers import AutoModelForCausalLM

    from miles_trainer import TrainBatch

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    rng = random.Random(0)
    tokens, lengths, logps, routed = [], [], [], []
    with torch.no_grad():
        for _ in range(16):
            p, r = rng.randint(4, 16), rng.randint(8, 24)
            toks = [rng.randrange(VOCAB) for _ in range(p + r)]
            out = model(input_ids=torch.tensor([toks], device=device), output_router_logits=True)
            lp = torch.log_softmax(out.logits[0].float(), -1)
            n = len(toks)
            logps.append([lp[n - r - 1 + j, toks[n - r + j]].item() for j in range(r)])
            top = torch.topk(torch.softmax(torch.stack(out.router_logits).float(), -1), TOP_K)
            routed.append(top.indices.permute(1, 0, 2)[:-1].to(torch.int32).cpu())
            tokens.append(toks)
            lengths.append(r)
    return TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=[[1] * r for r in lengths],
        rollout_logprobs=logps,
        rewards=[float(i % 2) for i in range(16)],
        group_ids=[i // 4 for i in range(16)],
        routed_experts=routed,
    )


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    if hasattr(trainer, "named_hf_tensors"):
        return {n: t.detach().cpu().clone() for n, t in trainer.named_hf_tensors()}
    return {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}


def check_backend(backend: str, dtype: str, rollout: Path, drifted: Path, tmp: Path) -> None:
    from safetensors.torch import load_file

    from miles_trainer import TrainerConfig, export_hf

    tag = f"{backend} {dtype}"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = rollout_batch(rollout, device)
    base = TrainerConfig(
        model_path=str(drifted), dtype=dtype, lr=1e-4, backend=backend, deterministic=True
    )
    metrics = {
        r3: dataclasses.replace(base, r3=r3).build().train_step(batch) for r3 in (False, True)
    }
    gap = [metrics[r3]["train_rollout_logprob_abs_diff"] for r3 in (False, True)]
    step(
        f"{tag}: R3 uses the rollout's experts and shrinks the gap",
        metrics[True]["r3_expert_match"] == 1.0 and gap[1] < gap[0],
        f"expert match {metrics[True]['r3_expert_match']:.4f}, router agreement "
        f"{metrics[False]['r3_router_agreement']:.4f}, gap {gap[0]:.4g} -> {gap[1]:.4g}",
    )
    cfg = dataclasses.replace(base, r3=True, num_minibatches=2, micro_batch_size=4)
    whole = cfg.build()
    want = [whole.train_step(batch) for _ in range(3)]
    first = cfg.build()
    first.train_step(batch)
    ckpt = tmp / f"{backend}-{dtype}"
    first.save_checkpoint(ckpt, step=1)
    first.save_hf_checkpoint(tmp / f"{backend}-{dtype}-hf", dtype="float32")
    del first
    resumed = cfg.build()
    info = resumed.load_checkpoint(ckpt)
    got = [resumed.train_step(batch) for _ in range(2)]
    w, g = weights(whole), weights(resumed)
    same = w.keys() == g.keys() and all(torch.equal(w[k], g[k]) for k in w)
    step(
        f"{tag}: stop after 1 step, resume, 2 more: bit-exact",
        info.step == 1 and got == want[1:] and same,
        "" if same else f"max diff {max((w[k] - g[k]).abs().max().item() for k in w):.3g}",
    )
    export_hf(ckpt, tmp / f"{backend}-{dtype}-export", dtype="float32")
    a = load_file(tmp / f"{backend}-{dtype}-export" / "model.safetensors")
    b = load_file(tmp / f"{backend}-{dtype}-hf" / "model.safetensors")
    step(
        f"{tag}: export_hf equals save_hf_checkpoint",
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU path (no GPU needed)")
    parser.add_argument("--backends", nargs="*", default=["fsdp", "megatron"])
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("FAIL setup: no CUDA device (use --cpu for the CPU path)")
        return 2
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="r3-resume-check-"))
    try:
        rollout, drifted = make_models(tmp)
        for backend in args.backends:
            for dtype in ("float32", "bfloat16"):
                try:
                    check_backend(backend, dtype, rollout, drifted, tmp)
                except Exception:
                    step(f"{backend} {dtype}", False, traceback.format_exc(limit=6))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{FAILS} FAIL(s) in {time.perf_counter() - t0:.0f} s", flush=True)
    return FAILS


if __name__ == "__main__":
    sys.exit(main())
