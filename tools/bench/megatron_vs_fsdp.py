"""Train-step time: the Megatron backend vs the FSDP2 backend on the same CPU workload.

Why: issue 29 asks what the second backend costs on the machines CI and the demo run on. Both
trainers take the same `TrainBatch` through the same loss hub; this times `train_step` on one
fixed workload (a Qwen3 built from a config, a batch of prompt + response samples with every
loss term on) for each layout:

- 1 process: Megatron TP 1 vs FSDP2 on one rank (a plain module: FSDP2 shards nothing);
- 2 processes (gloo): Megatron TP 2 (+ sequence parallelism) vs FSDP2 on two ranks, and
  Megatron DP 2 (distributed optimizer) vs FSDP2 on two ranks.

Each pair runs in one torchrun job that builds both trainers, warms each up with 2 steps, then
alternates their steps (``--steps`` rounds): the machine is shared, and a busy neighbour then
slows both sides of a round alike. The table gives each side's median step time, loss tokens/s
and the median over rounds of the per-round ratio Megatron / FSDP2. One intra-op thread per
process by default (``--threads``; the machine has 2 cores).

Laptop:   python tools/bench/megatron_vs_fsdp.py                    # ~3 min
          python tools/bench/megatron_vs_fsdp.py --hidden 256 --layers 2 --steps 3
Cluster:  the same script times the CPU path only (on GPUs use megatron's own tools).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIRS = [
    # (label, processes, megatron fields); each is timed against FSDP2 on as many processes
    ("megatron tp1", 1, {}),
    ("megatron tp2+sp", 2, {"tp": 2, "sequence_parallel": True}),
    ("megatron dp2", 2, {}),
]


def make_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(2, hidden // 256),
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def make_batch(n: int, vocab: int, seed: int = 0):  # -> TrainBatch
    import random

    from miles_trainer import TrainBatch

    rng = random.Random(seed)
    tokens, lengths, masks, rollout = [], [], [], []
    for _ in range(n):
        p, r = rng.randint(32, 96), rng.randint(64, 160)
        tokens.append([rng.randrange(2, vocab) for _ in range(p + r)])
        lengths.append(r)
        masks.append([1] * r)
        rollout.append([-3.0 + rng.uniform(-0.5, 0.5) for _ in range(r)])
    rewards = [float(rng.random() < 0.5) for _ in range(n)]
    return TrainBatch(
        tokens=tokens,
        response_lengths=lengths,
        loss_masks=masks,
        rollout_logprobs=rollout,
        rewards=rewards,
        group_ids=[i // 4 for i in range(n)],
    )


def worker(args: argparse.Namespace) -> None:
    """One rank of one pair (run under torchrun): both trainers, alternating steps; rank 0
    writes the step times as JSON."""
    import torch

    from miles_trainer import LossConfig, TrainerConfig
    from miles_trainer.megatron import MegatronConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trainers = {}
    for backend in ("fsdp", "megatron"):
        cfg = TrainerConfig(
            model_path=args.model,
            backend=backend,
            megatron=MegatronConfig(**json.loads(args.megatron)),
            dtype=args.dtype,
            lr=1e-6,
            micro_batch_size=args.micro_batch_size,
            num_minibatches=1,
            loss=LossConfig(),
        )
        trainers[backend] = cfg.build()
    batch = make_batch(args.batch, args.vocab)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    tokens = 0.0
    for i in range(args.steps + 2):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            tokens = trainer.train_step(batch)["tokens"]
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    if trainers["fsdp"].rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "tokens": tokens}))


def run_pair(label: str, nproc: int, megatron: dict, model: Path, args: argparse.Namespace) -> dict:
    out = Path(args.tmp) / f"{label.replace(' ', '_').replace('+', '')}-{args.dtype}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [
        "--nproc_per_node",
        str(nproc),
        __file__,
        "--worker",
        "--megatron",
        json.dumps(megatron),
    ]
    cmd += ["--model", str(model), "--out", str(out), "--dtype", args.dtype]
    cmd += ["--steps", str(args.steps), "--batch", str(args.batch), "--vocab", str(args.vocab)]
    cmd += ["--micro-batch-size", str(args.micro_batch_size)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
    result: dict = json.loads(out.read_text())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--megatron", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16, help="samples per train_step")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed rounds per pair")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dtypes to run (parent)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        model = Path(tmp) / "model"
        make_model(model, args.hidden, args.layers, args.vocab)
        print(
            f"Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch "
            f"{args.batch} samples (prompt 32-96 + response 64-160 tokens), micro-batch "
            f"{args.micro_batch_size}; {args.steps} alternating rounds after 2 warm-up steps"
        )
        print(
            "| dtype | procs | Megatron layout | Megatron step (s) | FSDP2 step (s) | "
            "Megatron tok/s | FSDP2 tok/s | Megatron / FSDP2 |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for dtype in args.dtypes.split(","):
            args.dtype = dtype
            for label, nproc, megatron in PAIRS:
                r = run_pair(label, nproc, megatron, model, args)
                mg, fs = r["times"]["megatron"], r["times"]["fsdp"]
                ratio = statistics.median(a / b for a, b in zip(mg, fs))
                m_med, f_med = statistics.median(mg), statistics.median(fs)
                print(
                    f"| {dtype} | {nproc} | {label.split(' ', 1)[1]} | {m_med:.3f} | "
                    f"{f_med:.3f} | {r['tokens'] / m_med:.0f} | {r['tokens'] / f_med:.0f} | "
                    f"{ratio:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
