"""R3: the train/rollout logprob gap on a tiny Qwen3-MoE, with and without routing replay.

Why: issue 29 asks that replaying the rollout's expert choices (``trainer.r3``) shrink the gap
between the trainer's logprobs and the rollout engine's, and that the figure be measured. The
rollout is the real embedded engine (``miles_rollout.Engine``, ``return_routed_experts``): it
samples responses at temperature 1 and records every token's experts per layer (SGLang's
layout). The trainer scores the same tokens (``train_step`` with lr 0, so nothing changes) with
replay on and off; the gap is the token mean of ``|train logp - rollout logp|``
(``train_rollout_logprob_abs_diff``). Three cases:

- ``floor``: engine and trainer in float32 on the same weights: numerics only (the limit any
  replay can reach; routing agrees unless a tie flips);
- ``bf16 rollout``: the engine in bfloat16, the trainer in float32, same weights (the classic
  precision mismatch: near-tied routers flip in bf16);
- ``stale k``: the engine on the weights of k trainer steps ago (asynchronous RL), float32
  both: the trainer's weights drifted by k RL steps (lr ``--lr``) from the rollout's.

Also reported: ``r3_router_agreement`` (the fraction of (token, layer) rows where the trainer's
own router picks the rollout's experts) and ``r3_expert_match`` (the experts actually used: 1.0
with replay).

Laptop:   python tools/bench/r3_logprob_gap.py                      # ~1-2 min on 2 cores
          python tools/bench/r3_logprob_gap.py --backend megatron   # the Megatron trainer
Cluster:  the same script on CPU; on GPUs compare an SGLang rollout with
          return_routed_experts against the trainer the same way.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def make_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def rollout(model_dir: Path, dtype: str, args: argparse.Namespace, seed: int) -> list[Any]:
    """Sample ``--samples`` responses with the embedded engine; keep ids, logprobs, experts."""
    from miles_rollout import EngineConfig, SamplingParams

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(args.vocab) for _ in range(rng.randint(4, 16))] for _ in range(args.samples)
    ]
    cfg = EngineConfig(model_path=str(model_dir), dtype=dtype, max_running_requests=args.samples)
    with cfg.build() as engine:
        futs = [
            engine.submit(
                p,
                SamplingParams(
                    max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=i
                ),
                return_routed_experts=True,
            )
            for i, p in enumerate(prompts)
        ]
        outs = [f.result(timeout=600) for f in futs]
    return [(p, o) for p, o in zip(prompts, outs)]


def batch_of(samples: list[Any]) -> Any:
    from miles_trainer import TrainBatch

    return TrainBatch(
        tokens=[p + o.output_ids for p, o in samples],
        response_lengths=[len(o.output_ids) for _, o in samples],
        loss_masks=[[1] * len(o.output_ids) for _, o in samples],
        rollout_logprobs=[list(o.output_logprobs) for _, o in samples],
        rewards=[float(i % 2) for i in range(len(samples))],
        group_ids=[i // 4 for i in range(len(samples))],
        routed_experts=[o.routed_experts for _, o in samples],
    )


def trainer_cfg(model_dir: Path, args: argparse.Namespace, *, r3: bool, lr: float) -> Any:
    from miles_trainer import TrainerConfig

    return TrainerConfig(
        model_path=str(model_dir), r3=r3, lr=lr, micro_batch_size=8, backend=args.backend
    )


def measure(model_dir: Path, batch: Any, args: argparse.Namespace) -> dict[bool, dict[str, float]]:
    """Gap metrics with replay off and on (lr 0: the weights do not move)."""
    out = {}
    for r3 in (False, True):
        trainer = trainer_cfg(model_dir, args, r3=r3, lr=0.0).build()
        out[r3] = trainer.train_step(batch)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("fsdp", "megatron"), default="fsdp")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--stale", type=int, nargs="*", default=[1, 4])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    rows: list[tuple[str, dict[bool, dict[str, float]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        w0 = make_model(Path(tmp) / "w0", args)
        fp32 = batch_of(rollout(w0, "float32", args, seed=1))
        rows.append(("floor: fp32 rollout, fp32 trainer, same weights", measure(w0, fp32, args)))
        bf16 = batch_of(rollout(w0, "bfloat16", args, seed=1))
        rows.append(("bf16 rollout, fp32 trainer, same weights", measure(w0, bf16, args)))
        # Trainer steps from w0 on fresh fp32 rollouts: the rollout weights are k steps old.
        trainer = trainer_cfg(w0, args, r3=False, lr=args.lr).build()
        for k in range(1, max(args.stale, default=0) + 1):
            trainer.train_step(batch_of(rollout(w0, "float32", args, seed=100 + k)))
            if k in args.stale:
                wk = Path(tmp) / f"w{k}"
                trainer.save_hf_checkpoint(wk)
                rows.append(
                    (f"stale {k}: rollout on weights {k} steps old", measure(wk, fp32, args))
                )
    took = time.perf_counter() - t_start
    print(
        f"\nR3 logprob gap: Qwen3-MoE hidden {args.hidden}, {args.layers} layers, "
        f"{args.experts} experts top-{args.top_k}; {args.samples} samples x {args.new_tokens} "
        f"tokens from the embedded engine; {args.backend} trainer ({took:.0f} s)\n"
    )
    print(
        "| case | gap, no replay | gap, R3 | ratio | router agreement | experts = rollout's (R3) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, m in rows:
        off, on = m[False], m[True]
        g_off, g_on = off["train_rollout_logprob_abs_diff"], on["train_rollout_logprob_abs_diff"]
        ratio = g_off / g_on if g_on > 0 else float("inf")
        print(
            f"| {name} | {g_off:.3g} | {g_on:.3g} | {ratio:.2f}x | "
            f"{off['r3_router_agreement']:.4f} | {on['r3_expert_match']:.4f} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
