"""miles-trainer's Megatron backend on one GPU: TP 1, a few steps on tiny models.

Why: the CPU machines run megatron-core through `miles_trainer.megatron.cpu_compat`; this is
the check that runs the untouched GPU path (NCCL group, CUDA params, megatron's own RNG tracker
and memory buffer, the fused kernels it enables on CUDA, the alltoall MoE dispatcher). Each step
prints PASS or FAIL; the exit status is the number of FAILs. Under 2 minutes on an H100.

    python tools/gpu_checks/megatron_check.py            # needs CUDA (see megatron_check.sh)
    python tools/gpu_checks/megatron_check.py --cpu      # the same steps on the CPU path

Checks, for a dense Qwen3 (hidden 256, 4 layers, fp32 and bf16) and a Qwen3-MoE (8 experts):
1. ``named_hf_tensors`` right after loading equals the HF checkpoint bit for bit;
2. ``compute_logprobs`` agrees with the HF model's ``log_softmax`` (fp32: 1e-4, bf16: 0.1);
3. five ``train_step``s on one fixed batch (positive advantages, the initial logprobs as the
   rollout logprobs, so the loss is ``-mean(ratio)``): every metric finite, the loss strictly
   decreasing, the responses' mean logprob rising;
4. ``save_hf_checkpoint`` reloads in transformers with the trained weights.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

FAILS = 0


def step(name: str, ok: bool, detail: str = "") -> None:
    global FAILS
    FAILS += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def make_model(path: Path, moe: bool) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = {
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "initializer_range": 0.05,
    }
    if moe:
        cfg = Qwen3MoeConfig(
            **common,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    else:
        cfg = Qwen3Config(**common, intermediate_size=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def fixed_batch(n: int = 8, vocab: int = 512) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(1)
    tokens, lengths = [], []
    for i in range(n):
        p, r = 6 + i % 5, 12 + (3 * i) % 9
        tokens.append(torch.randint(2, vocab, (p + r,), generator=g).tolist())
        lengths.append(r)
    return tokens, lengths


def check_model(model_dir: Path, *, dtype: str, moe: bool, device: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles_trainer import LossConfig, TrainBatch, TrainerConfig
    from miles_trainer.megatron import MegatronConfig
    from miles_trainer.megatron.convert import unstack_experts

    tag = f"{'moe' if moe else 'dense'}/{dtype}"
    mcfg = MegatronConfig(moe_token_dispatcher="alltoall" if device == "cuda" else "allgather")
    cfg = TrainerConfig(
        model_path=str(model_dir),
        backend="megatron",
        megatron=mcfg,
        dtype=dtype,
        lr=1e-4,
        grad_clip=1.0,
        micro_batch_size=4,
        loss=LossConfig(use_rollout_logprobs=True, clip_high=10.0),
    )
    t0 = time.perf_counter()
    trainer = cfg.build()
    step(
        f"{tag} build",
        trainer.device.type == device,
        f"{trainer.device}, {time.perf_counter() - t0:.1f}s",
    )

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = dict(unstack_experts(hf.state_dict().items()))
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    got = {n: t.float().cpu() for n, t in trainer.named_hf_tensors()}
    exact = got.keys() == want.keys() and all(
        torch.equal(got[n], w.to(getattr(torch, dtype)).float()) for n, w in want.items()
    )
    step(f"{tag} named_hf_tensors == checkpoint (bit for bit)", exact)

    tokens, lengths = fixed_batch()
    logp = trainer.compute_logprobs(tokens, lengths)
    worst = 0.0
    hf = hf.to(device).eval()
    with torch.no_grad():
        for toks, r, row in zip(tokens, lengths, logp):
            logits = hf(torch.tensor([toks], device=device)).logits[0].float().cpu()
            pos = torch.arange(len(toks) - r - 1, len(toks) - 1)
            ref = torch.log_softmax(logits, -1)[pos, torch.tensor(toks[len(toks) - r :])]
            worst = max(worst, (ref - torch.tensor(row)).abs().max().item())
    tol = 1e-4 if dtype == "float32" else 0.1
    step(f"{tag} compute_logprobs vs HF", worst < tol, f"max |diff| {worst:.2e} (tol {tol})")
    del hf

    batch = TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=[[1] * r for r in lengths],
        rollout_logprobs=logp,
        advantages=[[1.0] * r for r in lengths],
    )
    losses, mean_logp, times = [], [], []
    finite = True
    for _ in range(5):
        t0 = time.perf_counter()
        m = trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
        finite &= all(math.isfinite(v) for v in m.values()) and m["skipped_steps"] == 0
        losses.append(m["loss"])
        lp = trainer.compute_logprobs(tokens, lengths)
        mean_logp.append(sum(map(sum, lp)) / sum(lengths))
    step(f"{tag} metrics finite, no skipped step", finite)
    dec = all(b < a for a, b in itertools.pairwise(losses))
    step(f"{tag} loss decreasing", dec, " ".join(f"{x:.4f}" for x in losses))
    rise = all(b > a for a, b in itertools.pairwise(mean_logp))
    step(f"{tag} response logprob rising", rise, " ".join(f"{x:.4f}" for x in mean_logp))
    print(f"     step time: {' '.join(f'{t * 1e3:.0f}' for t in times)} ms", flush=True)

    with tempfile.TemporaryDirectory() as out:
        trainer.save_hf_checkpoint(Path(out) / "ckpt", dtype="float32")
        back = AutoModelForCausalLM.from_pretrained(Path(out) / "ckpt", dtype=torch.float32)
        after = dict(unstack_experts(back.state_dict().items()))
        final = {n: t.float().cpu() for n, t in trainer.named_hf_tensors()}
        same = all(torch.equal(after[n], final[n]) for n in final)
        moved = max((final[n] - want[n]).abs().max().item() for n in want)
        step(f"{tag} save_hf_checkpoint reloads the trained weights", same and moved > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU path (gloo, cpu_compat)")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL setup: no CUDA device (use --cpu for the CPU path)")
        return 2
    print("torch", torch.__version__, torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    try:
        import megatron.core

        print("megatron-core", megatron.core.__version__)
    except ImportError:
        print("FAIL setup: megatron-core is not importable (pip install 'miles-trainer[megatron]')")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        for moe, dtypes in ((False, ("float32", "bfloat16")), (True, ("float32",))):
            model_dir = make_model(Path(tmp) / ("moe" if moe else "dense"), moe)
            for dtype in dtypes:
                try:
                    check_model(model_dir, dtype=dtype, moe=moe, device=device)
                except Exception:  # report and go on with the next model
                    traceback.print_exc()
                    step(f"{'moe' if moe else 'dense'}/{dtype} ran without an exception", False)
    print(f"{FAILS} FAIL(s)")
    return min(FAILS, 100)


if __name__ == "__main__":
    sys.exit(main())
