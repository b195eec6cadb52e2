"""Train-step CPU time of the `gen` workload: the trainer's fused ops vs HF's modules, A/B.

Why: in the asynchronous loop generation is hidden, so miles' step time on `trl_vs_miles.py
--workload gen` is its training step; this measures that step alone, with and without
`miles_trainer.ops` (fused attention blocks and RMSNorm backward, shared prefixes computed
once), in one process, interleaved, on the machine's noisy shared cores. The peer is the
trainer's previous path in the same run: HF's attention modules and decoder stack through
autograd; in bf16 with the GQA eager attention's autograd maths
(`ops.attention.eager_reference`) and the RMSNorm function with its float32 backward, as
before; in float32 with HF's RMSNorms and SDPA.

The workload is `trl_vs_miles.py`'s `gen`: the 10.4M-parameter Qwen3 it builds, 8 arithmetic
prompts x 8 samples with 64 response tokens each (token ids drawn at random: the cost does not
depend on them), rollout logprobs from the trainer itself, GRPO advantages from random rewards,
the settings `miles train` gets there (lr 2e-4, eps 1e-6, clip 0.2/0.28, one micro-batch of
64, ``loss.use_rollout_logprobs``). Both trainers train on the same batch every round; the
order alternates per round. Timed: ``time.thread_time()`` around ``train_step`` (CPU time of
the one thread, far less noisy than wall time on a shared machine); the table gives each
side's median and minimum and the median of the per-round ratios.

Laptop:   .venv/bin/python tools/bench/train_step_ops.py --dtype bfloat16 --rounds 8
          .venv/bin/python tools/bench/train_step_ops.py --dtype float32 --rounds 4
Cluster:  CPU only (the ops are installed for low precision on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _model_dir() -> Path:
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import trl_vs_miles

    return trl_vs_miles._model_dir("gen")


def _batch(trainer: Any, model_dir: Path, seed: int = 0) -> Any:
    from transformers import AutoTokenizer

    from miles_rollout.tasks import ArithmeticTask
    from miles_trainer import TrainBatch

    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import trl_vs_miles as tvm

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = len(tok)
    rng = random.Random(seed)
    task = ArithmeticTask(**tvm.TASK_PARAMS)
    tokens, lengths = [], []
    n_tok = int(tvm.WORKLOADS["gen"]["tokens"])
    for item in task.sample(tvm.PROMPTS_PER_STEP):
        enc: Any = tok.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True)
        prompt = list(enc if isinstance(enc, list) else enc["input_ids"])
        for _ in range(tvm.SAMPLES_PER_PROMPT):
            tokens.append(prompt + [rng.randrange(3, vocab) for _ in range(n_tok)])
            lengths.append(n_tok)
    logp = trainer.compute_logprobs(tokens, lengths)
    return TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=[[1] * n for n in lengths],
        rollout_logprobs=[[x + rng.uniform(-0.01, 0.01) for x in row] for row in logp],
        rewards=[float(rng.random() < 0.5) for _ in tokens],
        group_ids=[i // tvm.SAMPLES_PER_PROMPT for i in range(len(tokens))],
    )


def _trainer(model_dir: Path, dtype: str) -> Any:
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import trl_vs_miles as tvm

    from miles_trainer import FSDPTrainer, TrainerConfig
    from miles_trainer.config import LossConfig

    cfg = TrainerConfig(
        model_path=str(model_dir),
        dtype=dtype,
        lr=tvm.LR,
        eps=tvm.ADAM_EPS,
        micro_batch_size=tvm.PROMPTS_PER_STEP * tvm.SAMPLES_PER_PROMPT,
        loss=LossConfig(
            clip_low=tvm.CLIP_LOW,
            clip_high=tvm.CLIP_HIGH,
            kl_coef=0.0,
            use_rollout_logprobs=True,
        ),
    )
    return FSDPTrainer(cfg)


def _unfuse(model: Any, dtype: str) -> int:
    """Give the model the forwards it had before the fused ops: HF's attention modules and
    decoder stack; HF's RMSNorms too in float32 (bf16 already had the trainer's norm)."""
    import types

    undo = ["miles_trainer.ops.attention_block", "miles_trainer.ops.shared_prefix"]
    if dtype == "float32":
        undo.append("miles_trainer.ops.rmsnorm")
    count = 0
    for module in model.modules():
        fwd = module.__dict__.get("forward")
        if isinstance(fwd, types.MethodType) and fwd.__func__.__module__ in undo:
            del module.forward
            count += 1
    return count


@contextlib.contextmanager
def _baseline_ops() -> Iterator[None]:
    """The ops as they were before the fused ones: the GQA eager attention through autograd
    (not `CausalAttentionFunction`) and the RMSNorm input gradient in float32 ops (not the
    fused LayerNorm kernel)."""
    from miles_trainer.ops import attention, rmsnorm

    fast_attention, fast_grad_x = attention.causal_attention, rmsnorm._grad_x_layer_norm
    attention.causal_attention = lambda *args, **kwargs: None
    rmsnorm._grad_x_layer_norm = rmsnorm._grad_x_float32
    try:
        yield
    finally:
        attention.causal_attention = fast_attention
        rmsnorm._grad_x_layer_norm = fast_grad_x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--rounds", type=int, default=8, help="timed steps per side, interleaved")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="also write the step times as JSON here")
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(args.threads)
    model_dir = _model_dir()
    fused = _trainer(model_dir, args.dtype)
    base = _trainer(model_dir, args.dtype)
    unfused = _unfuse(base.model, args.dtype)
    batch = _batch(fused, model_dir)

    def step(trainer: Any) -> tuple[float, float]:
        ctx = _baseline_ops() if trainer is base else contextlib.nullcontext()
        with ctx:
            t0, w0 = time.thread_time(), time.perf_counter()
            trainer.train_step(batch)
            return time.thread_time() - t0, time.perf_counter() - w0

    for t in (base, fused):  # warm-up
        step(t)
    times: dict[str, list[float]] = {"base": [], "fused": []}
    walls: dict[str, list[float]] = {"base": [], "fused": []}
    for r in range(args.rounds):
        order = [("base", base), ("fused", fused)]
        for name, trainer in order if r % 2 == 0 else order[::-1]:
            cpu, wall = step(trainer)
            times[name].append(cpu)
            walls[name].append(wall)
        print(
            f"round {r}: base {times['base'][-1]:.3f} s, fused {times['fused'][-1]:.3f} s "
            f"(CPU), load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    ratios = [b / f for b, f in zip(times["base"], times["fused"])]
    summary = {
        "dtype": args.dtype,
        "threads": args.threads,
        "rounds": args.rounds,
        "modules_unfused_in_base": unfused,
        "base_cpu_s": times["base"],
        "fused_cpu_s": times["fused"],
        "base_wall_s": walls["base"],
        "fused_wall_s": walls["fused"],
        "speedup_median": statistics.median(ratios),
    }
    print(
        f"\n| dtype | rounds | base CPU s/step median (min) | fused CPU s/step median (min) "
        f"| speed-up (median of per-round ratios) |\n| --- | --- | --- | --- | --- |\n"
        f"| {args.dtype} | {args.rounds} "
        f"| {statistics.median(times['base']):.3f} ({min(times['base']):.3f}) "
        f"| {statistics.median(times['fused']):.3f} ({min(times['fused']):.3f}) "
        f"| {summary['speedup_median']:.3f}x |"
    )
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
