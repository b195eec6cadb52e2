"""Generation throughput: the miles-rollout engine vs HF ``model.generate`` on a padded batch.

Why: the RL loop is generation-bound on CPU, and TRL's GRPOTrainer (our named peer) generates
with ``model.generate`` on one left-padded batch. This script builds a ~10M-parameter Qwen3
from a config (random weights, no download), then times the same prompts both ways with
sampling at temperature 1 (no top-k/top-p) and every request forced to ``--new-tokens`` tokens
(EOS ignored), so both sides produce exactly the same number of tokens. ``--group-size 8``
repeats each prompt 8 times, as GRPO does (the engine then prefills each prompt once).

``--compare-attention`` also runs the engine on PyTorch ops only (``kernel_backend="torch"``)
next to its native kernels (miles_rollout._ext: attention, and RMSNorm in bf16). In float32
that compares the batch-invariant engine (the kernel's attention, GEMM rows padded to a multiple
of 4) with SDPA. In bf16 it also times one layer's decode attention and one RMSNorm of the
hidden rows both ways on this model's shape (64 rows, lengths as at mid-generation) in thread
CPU time, which other processes on a shared machine disturb less than wall time.

Laptop:   python tools/bench/engine_throughput.py                # ~1 min on 2 cores
          python tools/bench/engine_throughput.py --threads 1 --repeat 3
          python tools/bench/engine_throughput.py --threads 1 --repeat 3 --dtype bfloat16 \
              --hidden 384 --intermediate 1152 --layers 6 --heads 6 --compare-attention
Cluster:  not meant for GPUs (the embedded engine is CPU-only); benchmark SGLang instead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch


def build_model(args: argparse.Namespace, path: str) -> int:
    """Write a random Qwen3 checkpoint to ``path``; return its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``requests`` prompts: ``requests / group_size`` distinct ones, each repeated (as in GRPO)."""
    rng = random.Random(0)
    distinct = [
        [rng.randrange(args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(-(-args.requests // args.group_size))
    ]
    return [distinct[i // args.group_size] for i in range(args.requests)]


def bench_hf(path: str, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype) -> float:
    """Seconds for one ``model.generate`` call over all prompts (left-padded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = {
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "pad_token_id": 0,
        "eos_token_id": None,
    }
    with torch.inference_mode():
        model.generate(
            ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
        )
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return elapsed


def bench_engine(
    path: str, prompts: list[list[int]], new_tokens: int, dtype: str, attention: str = "auto"
) -> float:
    """Seconds for the engine to finish all prompts submitted at once."""
    from miles_rollout import EngineConfig, SamplingParams

    engine = EngineConfig(
        model_path=path,
        dtype=dtype,
        max_running_requests=len(prompts),
        kernel_backend=attention,
    ).build()
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
        engine.generate(prompts[0][:4], SamplingParams(max_new_tokens=2))
        start = time.perf_counter()
        futures = [engine.submit(p, params) for p in prompts]
        outs = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    assert all(o.completion_tokens == new_tokens for o in outs)
    return elapsed


def bench_attention(args: argparse.Namespace, repeat: int) -> dict[str, list[float]]:
    """Thread-CPU microseconds of one layer's bf16 decode attention and of one RMSNorm of the
    hidden rows, per backend (interleaved)."""
    from miles_rollout._decode_attention import decode_attention
    from miles_rollout._rms_norm import native_rms_norm, torch_rms_norm

    gen = torch.Generator().manual_seed(0)
    n, kv, hd = args.requests, args.kv_heads, args.hidden // args.heads
    group = args.heads // kv
    t_cap = 128
    while t_cap < args.max_prompt + args.new_tokens:
        t_cap *= 2
    qk = torch.randn(n, args.heads + kv, hd, generator=gen).bfloat16()
    q = qk[:, : args.heads].reshape(n, kv, group, hd)  # the engine's strided view
    k = torch.randn(n, kv, t_cap, hd, generator=gen).bfloat16()
    v = torch.randn(n, kv, t_cap, hd, generator=gen).bfloat16()
    # Mid-generation: each prompt plus half the new tokens.
    lo, hi = args.min_prompt + args.new_tokens // 2, args.max_prompt + args.new_tokens // 2
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen)
    scale = hd**-0.5
    calls = 200
    x = torch.randn(n, args.hidden, generator=gen).bfloat16()
    w = torch.randn(args.hidden, generator=gen).bfloat16()
    norms = {"norm torch": torch_rms_norm, "norm native": native_rms_norm}
    out: dict[str, list[float]] = {"torch": [], "native": [], **{name: [] for name in norms}}
    for _ in range(repeat):
        for backend in ("torch", "native"):
            decode_attention(q, k, v, lengths, scale, backend=backend)
            start = time.thread_time()
            for _ in range(calls):
                decode_attention(q, k, v, lengths, scale, backend=backend)
            out[backend].append((time.thread_time() - start) / calls * 1e6)
        for name, norm in norms.items():
            start = time.thread_time()
            for _ in range(calls):
                norm(x, w, 1e-6)
            out[name].append((time.thread_time() - start) / calls * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--group-size", type=int, default=1, help="completions per distinct prompt (GRPO: 8)"
    )
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeat", type=int, default=2, help="alternating runs of each side")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--compare-attention",
        action="store_true",
        help="engine with native kernels vs PyTorch ops (bf16: plus a per-layer timing)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    prompts = make_prompts(args)
    tokens = args.requests * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(args, tmp)
        print(
            f"Qwen3 {n_params / 1e6:.1f}M params, {args.dtype}, {args.requests} requests x "
            f"{args.new_tokens} new tokens, prompts {args.min_prompt}-{args.max_prompt} tokens "
            f"(groups of {args.group_size}), "
            f"{torch.get_num_threads()} threads"
        )
        hf: list[float] = []
        eng: list[float] = []
        eng_torch: list[float] = []
        for _ in range(args.repeat):  # alternate so background load hits both sides alike
            if not args.skip_hf:
                hf.append(bench_hf(tmp, prompts, args.new_tokens, dtype))
            eng.append(bench_engine(tmp, prompts, args.new_tokens, args.dtype))
            if args.compare_attention:
                eng_torch.append(
                    bench_engine(tmp, prompts, args.new_tokens, args.dtype, attention="torch")
                )
        # Best and median: on a shared machine the best run is the least disturbed one.
        e_best, e_med = min(eng), statistics.median(eng)
        print(
            f"engine      : best {tokens / e_best:7.0f} tok/s, median {tokens / e_med:7.0f} tok/s"
        )
        if hf:
            h_best, h_med = min(hf), statistics.median(hf)
            h_rates = f"best {tokens / h_best:7.0f} tok/s, median {tokens / h_med:7.0f} tok/s"
            print(f"HF generate : {h_rates}")
            print(f"speed-up    : best {h_best / e_best:.2f}x, median {h_med / e_med:.2f}x")
        if eng_torch:
            t_best, t_med = min(eng_torch), statistics.median(eng_torch)
            print(
                f"engine, PyTorch ops only: best {tokens / t_best:7.0f} tok/s, median "
                f"{tokens / t_med:7.0f} tok/s (native kernels: {t_med / e_med:.2f}x median)"
            )
            if args.dtype != "bfloat16":
                return
            per_layer = bench_attention(args, args.repeat)
            nat, tor = min(per_layer["native"]), min(per_layer["torch"])
            print(
                f"decode attention, one layer ({args.requests} rows, thread CPU time, best of "
                f"{args.repeat}): native {nat:.0f} us, torch {tor:.0f} us ({tor / nat:.1f}x)"
            )
            nat, tor = min(per_layer["norm native"]), min(per_layer["norm torch"])
            print(
                f"RMSNorm [{args.requests}, {args.hidden}] (thread CPU time, best of "
                f"{args.repeat}): native {nat:.1f} us, torch {tor:.1f} us ({tor / nat:.1f}x)"
            )


if __name__ == "__main__":
    main()
