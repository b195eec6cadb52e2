"""What low-precision serving costs the embedded engine, and why it dequantizes once per update.

Why: the engine quantizes what it receives at every weight update (miles-quant) and computes
with the dequantized weights. This measures, on one model, per ``weight_format``:

- the update: ``update_weights_from_tensor`` of every weight, next to the same update of the
  unquantized bf16 engine (the named peer: the copy alone) and a plain memcpy of the bytes;
- what dequantize-on-the-fly would add to every forward: one ``dequantize`` of every quantized
  weight, next to the bf16 engine's own decode step at batch 16 (what it would be added to);
- decode throughput of the quantized engine against the bf16 engine (the same GEMMs: equal
  within noise).

    python tools/bench/lowprec_engine.py                      # SmolLM2-135M-Instruct (cached)
    python tools/bench/lowprec_engine.py --model ./ckpt --formats nvfp4 mxfp8

Runs on the CPU here; on a GPU machine the same engine path runs (the embedded engine is CPU
only): the GPU comparison is SGLang's own kernels, out of scope of this script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from typing import Any

import torch

FORMATS = ("fp8_block128", "mxfp8", "nvfp4", "mxfp4", "int4_g32")


def _median_s(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dequantize_all(quant: Any) -> None:
    """What a dequantize-on-the-fly engine would add to every forward pass."""
    import miles_quant as mq

    for name in quant.names:
        mq.dequantize(quant.quantized(name), torch.bfloat16)


def _decode_tok_s(engine: Any, batch: int, tokens: int) -> float:
    from miles_rollout import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=1)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(16)] for i in range(batch)]
    engine.generate(prompts[0], SamplingParams(max_new_tokens=2))  # warm-up
    t0 = time.perf_counter()
    futs = [engine.submit(p, params) for p in prompts]
    n = sum(len(f.result().output_ids) for f in futs)
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint (default: SmolLM2-135M, cached)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    from miles_rollout import EngineConfig

    if args.model is None:
        from miles_rollout.models import smollm2_dir

        args.model = str(smollm2_dir())
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, isa via miles-quant")
    base = EngineConfig(model_path=args.model, dtype="bfloat16", num_threads=1).build()
    params = [(n, t.detach().clone()) for n, t in base.model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in params)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.fill_(0)
    memcpy = _median_s(lambda: dst.copy_(src), args.repeat)
    upd_base = _median_s(lambda: base.update_weights_from_tensor(params), args.repeat)
    tok_base = _decode_tok_s(base, args.batch, args.tokens)
    step_base = args.batch / tok_base  # seconds per decode step at this batch
    base.shutdown()
    print(
        f"\nweights {nbytes / 2**20:.0f} MiB bf16; memcpy {memcpy * 1e3:.0f} ms; bf16 update "
        f"{upd_base * 1e3:.0f} ms; bf16 decode {tok_base:.0f} tok/s at batch {args.batch} "
        f"({step_base * 1e3:.1f} ms per step)\n"
    )
    print(
        "| format | quantized weights | update ms (x bf16 update) | dequantize all ms "
        "(x decode step) | decode tok/s (x bf16) | codes+scales MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for fmt in args.formats:
        try:
            cfg = EngineConfig(
                model_path=args.model, dtype="bfloat16", num_threads=1, weight_format=fmt
            )
            engine = cfg.build()
        except ValueError as e:
            print(f"| {fmt} | cannot serve: {str(e)[:90]} | | | | |")
            continue
        quant = engine.quantized_weights
        assert quant is not None
        upd = _median_s(partial(engine.update_weights_from_tensor, params), args.repeat)
        deq = _median_s(partial(_dequantize_all, quant), args.repeat)
        tok = _decode_tok_s(engine, args.batch, args.tokens)
        engine.shutdown()
        print(
            f"| {fmt} | {len(quant.names)} | {upd * 1e3:.0f} ({upd / upd_base:.1f}x) | "
            f"{deq * 1e3:.0f} ({deq / step_base:.1f}x) | {tok:.0f} ({tok / tok_base:.2f}x) | "
            f"{quant.nbytes() / 2**20:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
