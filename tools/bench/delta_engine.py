"""Generation pause per weight update: disk delta vs a full update, on the embedded engine.

Why: the point of materializing a delta before pausing is that generation stops only for the
swap. This script serves the first version of an RL run (bf16) on the miles-rollout engine,
keeps it busy with a stream of requests, and for each later step of the run updates it three
ways, in turn, measuring how long generation is paused (pause -> update -> continue):

- delta, tensors: ``update_engine_from_delta`` (only the changed tensors are sent);
- delta, disk: ``update_engine_via_disk`` (new checkpoint dir materialized first, then one
  ``update_weights_from_disk``, the SGLang route; the engine reads the files while paused);
- full (peer): every tensor of the new version through ``update_weights_from_tensor``.

After every update the engine's weights are checked bit for bit against the version.

Laptop (after the RL run of tools/bench/delta_rl.py's docstring; about a minute):
    python tools/bench/delta_engine.py runs/delta-1e-6 --base ~/.cache/miles/tiny-qwen3-arith
Cluster: not meant for it (the embedded engine is CPU-only); use an SGLang server.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from miles_rollout import EngineConfig, SamplingParams
from miles_transfer import tensor_digest, update_engine_from_delta
from miles_transfer.checkpoint import iter_safetensors
from miles_transfer.delta import encode_delta, update_engine_via_disk
from miles_transfer.delta.format import MemoryCheckpoint


def bf16_dir(src: Path, dst: Path) -> Path:
    """``src`` (fp32) cast to bf16 into ``dst``, with its other files (config, tokenizer)."""
    items = [(n, t.to(torch.bfloat16)) for n, t in iter_safetensors(src)]
    other = {
        p.name: p.read_bytes()
        for p in src.iterdir()
        if p.is_file() and p.suffix != ".safetensors" and not p.name.startswith(".")
    }
    dst.mkdir(parents=True)
    MemoryCheckpoint(items, other).write(dst)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a miles run directory (checkpoints/step_*)")
    p.add_argument("--base", type=Path, required=True, help="the policy the run started from")
    p.add_argument("--steps", type=int, default=12, help="updates per method")
    p.add_argument("--inflight", type=int, default=16, help="requests kept in flight")
    args = p.parse_args()
    torch.set_num_threads(1)

    chain = [args.base, *sorted((args.run_dir / "checkpoints").glob("step_*"))]
    chain = chain[: 3 * args.steps + 1]
    with tempfile.TemporaryDirectory(prefix="delta_engine_") as tmp:
        work = Path(tmp)
        dirs = [bf16_dir(c, work / f"v{i}") for i, c in enumerate(chain)]
        engine = EngineConfig(model_path=str(dirs[0]), dtype="bfloat16").build()
        stop = threading.Event()
        tokens = [0]

        def load() -> None:  # keep the engine generating throughout
            params = SamplingParams(max_new_tokens=24, ignore_eos=True)
            futures = [engine.submit([1, 5, 7], params) for _ in range(args.inflight)]
            while not stop.is_set():
                done = futures.pop(0).result()
                tokens[0] += len(done.output_ids)
                futures.append(engine.submit([1, 5, 7], params))

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        pauses: dict[str, list[float]] = {"delta, tensors": [], "delta, disk": [], "full": []}
        prep: dict[str, list[float]] = {k: [] for k in pauses}
        methods = list(pauses)
        try:
            for i in range(1, len(dirs)):
                method = methods[(i - 1) % 3]
                prev, new = dirs[i - 1], dirs[i]
                delta = encode_delta(prev, new, work / f"d{i}", version=str(i))
                if method == "delta, tensors":
                    r = update_engine_from_delta(engine, prev, delta.path)
                    pause, ready = r.pause_seconds, r.materialize_seconds
                elif method == "delta, disk":
                    out = work / f"m{i}"
                    r = update_engine_via_disk(engine, prev, delta.path, out)
                    pause, ready = r.pause_seconds, r.materialize_seconds
                    dirs[i] = out
                else:
                    t0 = time.perf_counter()
                    items = list(iter_safetensors(new))
                    ready = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    engine.pause_generation("in_place")
                    try:
                        engine.update_weights_from_tensor(items, weight_version=str(i))
                    finally:
                        engine.continue_generation()
                    pause = time.perf_counter() - t0
                want = {n: tensor_digest(t) for n, t in iter_safetensors(dirs[i])}
                assert engine.weights_checksum(list(want)) == want, f"step {i}: weights differ"
                pauses[method].append(pause)
                prep[method].append(ready)
        finally:
            stop.set()
            worker.join(timeout=60)
            engine.shutdown()

    nbytes = sum(t.numel() * t.element_size() for _, t in iter_safetensors(chain[0])) // 2
    print(f"run {args.run_dir}: {len(dirs) - 1} updates, checkpoint {nbytes} bytes in bf16, ")
    print(f"{args.inflight} requests in flight throughout ({tokens[0]} tokens generated)")
    print("| update | before the pause (median) | generation paused (median, max) |")
    print("| --- | --- | --- |")
    for m in methods:
        print(
            f"| {m} | {1e3 * statistics.median(prep[m]):.1f} ms | "
            f"{1e3 * statistics.median(pauses[m]):.2f} ms ({1e3 * max(pauses[m]):.2f} ms) |"
        )


if __name__ == "__main__":
    main()
