"""Disk-delta size on a real RL run: per-step changed fraction and payload vs a full update.

Why: a disk delta is only worth it if few rollout-precision elements change per step. This
script reads the per-step HF checkpoints of an RL run (fp32 master weights, as the trainer
writes them), casts each to the rollout precision (bf16; FP8 / MXFP4 / NVFP4 through
miles-quant's checkpoint export when it is installed), diffs consecutive versions with
miles-transfer and reports, per step and precision: the fraction of elements whose bits changed,
and the xor / overwrite delta payload as a fraction of the full checkpoint in that precision.

Laptop (about 3 min for the run, under a minute for this script):
    python tools/make_tiny_model.py
    miles train arith-tiny --set run.save_every=1 --steps 30 --out runs/delta-2e-4
    miles train arith-tiny --set run.save_every=1 --set trainer.lr=1e-6 --steps 30 \\
        --out runs/delta-1e-6
    python tools/bench/delta_rl.py runs/delta-2e-4 --base ~/.cache/miles/tiny-qwen3-arith
Cluster: the same on any run directory with checkpoints every step (bigger is slower: each
    checkpoint is read once per precision).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from miles_transfer.checkpoint import iter_safetensors
from miles_transfer.delta.encode import encode_checkpoints
from miles_transfer.delta.format import CheckpointIndex, MemoryCheckpoint

QUANT_FORMATS = ("fp8_block128", "mxfp4", "nvfp4")
_PACKED_FP4 = ("mxfp4", "nvfp4")


def bf16_checkpoint(path: Path) -> MemoryCheckpoint:
    """The checkpoint with floating tensors cast to bf16 (the rollout precision)."""
    items = [
        (n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in iter_safetensors(path)
    ]
    other = {
        p.name: p.read_bytes()
        for p in path.iterdir()
        if p.is_file() and p.suffix != ".safetensors" and not p.name.startswith(".")
    }
    return MemoryCheckpoint(items, other)


def changed_elements(a: CheckpointIndex, b: CheckpointIndex, fmt: str) -> tuple[int, int]:
    """(changed, total) elements; packed FP4 bytes count as two codes each."""
    changed = total = 0
    for name in b.tensors:
        x, y = a.read(name), b.read(name)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        diff = x.reshape(-1).view(ints) ^ y.reshape(-1).view(ints)
        if fmt in _PACKED_FP4 and y.dtype == torch.uint8 and not name.endswith("scales"):
            d = diff.to(torch.int16)
            changed += int(((d & 0xF) != 0).sum() + ((d >> 4) != 0).sum())
            total += 2 * y.numel()
        else:
            changed += int((diff != 0).sum())
            total += y.numel()
    return changed, total


def export(src: MemoryCheckpoint, fmt: str, work: Path, tag: str) -> CheckpointIndex:
    """Write ``src`` (bf16) to disk and export it to ``fmt`` with miles-quant."""
    from miles_quant.checkpoint import export_checkpoint

    plain = work / f"{tag}-bf16"
    if not plain.exists():
        plain.mkdir()
        src.write(plain)
    out = work / f"{tag}-{fmt}"
    export_checkpoint(plain, out, fmt)
    return CheckpointIndex(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a miles run directory (checkpoints/step_*)")
    p.add_argument("--base", type=Path, required=True, help="the policy the run started from")
    p.add_argument("--precisions", nargs="+", default=["bf16", *QUANT_FORMATS])
    p.add_argument("--json", type=Path, help="write the per-step numbers here")
    args = p.parse_args()

    steps = sorted((args.run_dir / "checkpoints").glob("step_*"))
    if not steps:
        raise SystemExit(f"{args.run_dir}/checkpoints has no step_* (run with run.save_every=1)")
    chain = [args.base, *steps]
    precisions = list(args.precisions)
    if any(f in QUANT_FORMATS for f in precisions):
        try:
            import miles_quant.checkpoint  # noqa: F401
        except ImportError as e:
            print(f"miles-quant unavailable ({e}): bf16 only")
            precisions = [f for f in precisions if f not in QUANT_FORMATS]

    results: dict[str, list[dict[str, float]]] = {f: [] for f in precisions}
    with tempfile.TemporaryDirectory(prefix="delta_rl_") as tmp:
        work = Path(tmp)
        bf16 = [bf16_checkpoint(c) for c in chain]
        for fmt in precisions:
            ckpts = (
                bf16
                if fmt == "bf16"
                else [export(c, fmt, work, f"v{i}") for i, c in enumerate(bf16)]
            )
            for i in range(1, len(ckpts)):
                row: dict[str, float] = {"step": i}
                changed, total = changed_elements(ckpts[i - 1], ckpts[i], fmt)
                row["changed_fraction"] = changed / total
                for enc in ("xor", "overwrite"):
                    out = work / f"d-{fmt}-{i}-{enc}"
                    r = encode_checkpoints(ckpts[i - 1], ckpts[i], out, encoding=enc)
                    row[f"{enc}_payload_fraction"] = r.payload_fraction
                    row[f"{enc}_bin_fraction"] = r.payload_bytes / r.full_bytes
                    row[f"{enc}_manifest_bytes"] = r.manifest_bytes
                    row["full_bytes"] = r.full_bytes
                results[fmt].append(row)
            changed, total = changed_elements(ckpts[0], ckpts[-1], fmt)
            results[fmt].append({"step": -1, "changed_fraction": changed / total})

    print(f"run {args.run_dir} ({len(steps)} steps), base {args.base}")
    print(
        "| precision | full bytes | changed/step median (min-max) | xor payload/step median "
        "(max) | of which delta.bin | manifest bytes | overwrite payload/step median (max) "
        "| changed after all steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for fmt, rows in results.items():
        per = rows[:-1]
        ch = [r["changed_fraction"] for r in per]
        xo = [r["xor_payload_fraction"] for r in per]
        ow = [r["overwrite_payload_fraction"] for r in per]
        xb = statistics.median(r["xor_bin_fraction"] for r in per)
        mb = statistics.median(r["xor_manifest_bytes"] for r in per)
        print(
            f"| {fmt} | {int(per[0]['full_bytes'])} | {100 * statistics.median(ch):.2f}% "
            f"({100 * min(ch):.2f}-{100 * max(ch):.2f}%) | {100 * statistics.median(xo):.2f}% "
            f"({100 * max(xo):.2f}%) | {100 * xb:.2f}% | {int(mb)} "
            f"| {100 * statistics.median(ow):.2f}% ({100 * max(ow):.2f}%) "
            f"| {100 * rows[-1]['changed_fraction']:.1f}% |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
