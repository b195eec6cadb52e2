"""Disk-delta encode / apply throughput vs a memcpy of the same bytes.

Why: a delta must be cheaper to build and apply than the copy it replaces. This script builds a
bf16 "model" of ``--mb`` MiB (tensors shaped like transformer layers), changes ``--changed`` of
its elements the way an optimizer step does (a small relative nudge at random positions; the
fraction measured on a real RL run is the default), and times, best of ``--repeat``, each on
the full checkpoint's bytes:

- memcpy: ``torch`` copy of every tensor into pre-faulted buffers (the peer);
- encode: ``encode_checkpoints`` in memory -> delta directory (compare, compress, checksums),
  as ``DeltaPublisher`` runs it (the base's checksums known from its own publish) and as the
  command line runs it (both sides hashed);
- apply (in memory): decode every chunk, patch, checksum every result tensor (what an engine
  host does before ``update_weights_from_tensor``; nothing written);
- apply (to disk): write the whole new checkpoint directory (adds a full disk write).

``--backend`` picks the chunk kernels (``auto``: the native ones when built); ``--compare-torch``
adds the PyTorch path's encode and apply rows to the same interleaved rounds; ``--isa`` forces
the native kernels' instruction set (AVX2 or portable code on an AVX-512 machine).

GB/s counts the checkpoint's bytes (not the delta's). Laptop: ``python
tools/bench/delta_speed.py`` (about 1 min on 2 cores). Cluster: ``--mb 8192``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from miles_transfer.delta.encode import encode_checkpoints
from miles_transfer.delta.format import MemoryCheckpoint
from miles_transfer.delta.materialize import materialize_checkpoint
from miles_transfer.delta.native import _ext, delta_isa


def make_model(mb: int, changed: float, seed: int) -> tuple[list[tuple[str, torch.Tensor]], ...]:
    """(base, new): bf16 tensors of 4096 x 1024 (8 MiB) plus one odd-sized tail tensor."""
    g = torch.Generator().manual_seed(seed)
    total = mb * 2**20 // 2
    base, new = [], []
    i = 0
    while total > 0:
        n = min(total, 4096 * 1024)
        w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        hit = torch.rand(n, generator=g) < changed * 1.6  # ~1/1.6 of nudges survive bf16
        v = w.clone()
        v[hit] = (w[hit].float() * (1 + 8e-3 * torch.randn(int(hit.sum()), generator=g))).to(
            torch.bfloat16
        )
        base.append((f"model.layers.{i}.weight", w))
        new.append((f"model.layers.{i}.weight", v))
        total -= n
        i += 1
    return base, new


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512, help="checkpoint size in MiB (bf16)")
    p.add_argument("--changed", type=float, default=0.0164, help="fraction of elements changed")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--encoding", choices=("xor", "overwrite"), default="xor")
    p.add_argument("--workdir", type=Path, default=None, help="where deltas are written")
    p.add_argument("--backend", choices=("auto", "native", "torch"), default="auto")
    p.add_argument(
        "--compare-torch", action="store_true", help="also time the torch path in each round"
    )
    p.add_argument(
        "--isa",
        choices=("avx512", "avx2", "generic"),
        default=None,
        help="force the native kernels' instruction set (default: the best this CPU has)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa and (_ext is None or not _ext.delta_use_isa(args.isa)):
        p.error(f"--isa {args.isa}: not available here (native kernels: {delta_isa()})")

    base_items, new_items = make_model(args.mb, args.changed, seed=0)
    base, new = MemoryCheckpoint(base_items), MemoryCheckpoint(new_items)
    nbytes = sum(e.nbytes for e in new.tensors.values())
    dst = [torch.empty_like(t) for _, t in new_items]
    for d in dst:
        d.fill_(0)  # pre-fault: first-touch page faults would dominate otherwise

    def memcpy() -> None:
        for d, (_, t) in zip(dst, new_items, strict=True):
            d.copy_(t)

    work = Path(tempfile.mkdtemp(prefix="delta_speed_", dir=args.workdir))
    try:
        counter = [0]
        last: list[object] = []

        def encode(backend: str = args.backend) -> None:
            # As in DeltaPublisher: the base was hashed when it was published, the new
            # version is hashed here.
            new.checksums.clear()
            counter[0] += 1
            out = work / f"d{counter[0]}"
            last[:] = [
                encode_checkpoints(
                    base,
                    new,
                    out,
                    encoding=args.encoding,
                    backend=backend,  # type: ignore[arg-type]
                )
            ]

        def encode_cold() -> None:
            # As the CLI on two directories: both sides hashed.
            base.checksums.clear()
            encode()

        def apply_memory(backend: str = args.backend) -> None:
            materialize_checkpoint(base, work / f"d{counter[0]}", None, backend=backend)  # type: ignore[arg-type]

        def apply_disk() -> None:
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            materialize_checkpoint(base, work / f"d{counter[0]}", out, backend=args.backend)

        # Interleaved: one of each per round, best of the rounds, so a burst of other jobs on
        # the shared machine hits every operation alike.
        ops = {
            "memcpy (peer)": memcpy,
            "encode (publisher: base hashed before)": encode,
            "encode (CLI: both hashed)": encode_cold,
            "apply in memory": apply_memory,
            "apply to disk (new dir)": apply_disk,
        }
        if args.compare_torch:
            ops["encode, torch path (publisher)"] = lambda: encode("torch")
            ops["apply in memory, torch path"] = lambda: apply_memory("torch")
        times = {name: float("inf") for name in ops}
        for _ in range(args.repeat):
            for name, fn in ops.items():
                times[name] = min(times[name], best(fn, 1))
        report = last[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gbs = nbytes / 1e9
    print(
        f"checkpoint {nbytes / 2**20:.0f} MiB bf16, {args.encoding}, "
        f"{torch.get_num_threads()} torch threads, backend {args.backend} (native kernels: "
        f"{delta_isa() or 'not built'}); {report.summary()}"  # type: ignore[attr-defined]
    )
    print("| operation | seconds | GB/s | vs memcpy |")
    print("| --- | --- | --- | --- |")
    t_copy = times["memcpy (peer)"]
    for name, t in times.items():
        print(f"| {name} | {t:.3f} | {gbs / t:.2f} | {t_copy / t:.0%} |")


if __name__ == "__main__":
    main()
