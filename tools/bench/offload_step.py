"""Optimizer step time and peak memory: AdamW state on NVMe vs in RAM vs the I/O bound.

Why: NVMe offload trades optimizer-state memory for disk traffic. This script measures, on a
1-2 GB AdamW state (fp32 master + exp_avg + exp_avg_sq, 12 bytes per parameter):

- step time with ``offload="nvme"`` (state streamed through three bucket buffers), with
  ``offload="cpu"`` (all state in RAM) and with ``torch.optim.AdamW(foreach=False)`` (the same
  arithmetic on ordinary tensors);
- the I/O bound of an NVMe step: bytes read / fio read GB/s + bytes written / fio write GB/s,
  with fio running sequential O_DIRECT io_uring jobs that move a step's bytes with the
  pager's block size and queue depth on the same disk (overwriting a laid-out file, buffers
  on huge pages like the optimizer's); the efficiency is bound / step time (target >= 0.8).
  A second peer runs what a step does to the disk: fio reading a step's bytes from one file
  while writing a step's bytes to another (two concurrent jobs); its time / step time says how
  close the step comes to the disk under the same mixed load;
  A VM's disk changes speed from minute to minute, so the script runs rounds of (nvme steps,
  then fio right after) and reports each round's efficiency and their median;
- peak resident optimizer memory: the pager's own accounting (bucket buffers in use at once)
  and the process's peak RSS growth over the parameters and gradients (each mode runs in a
  fresh subprocess, buffers pre-faulted).

Laptop:   python tools/bench/offload_step.py                 # ~1.5 min: 90M params, 1.08 GB state
          python tools/bench/offload_step.py --params-m 40 --bucket-mb 32 --steps 2
Cluster:  python tools/bench/offload_step.py --dir /local_nvme/tmp --params-m 500
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this (fresh) process; returns timings and memory as a dict."""
    import miles_offload as mo

    torch.set_num_threads(args.threads)
    n = int(args.params_m * 1e6)
    sizes = [n // 8] * 7 + [n - 7 * (n // 8)]  # 8 parameters, several buckets each
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    base_rss = rss_bytes()
    base_peak = peak_rss_bytes()
    t0 = time.perf_counter()
    if args.mode == "torch":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    else:
        opt = mo.AdamW(
            params,
            lr=1e-4,
            offload=args.mode,
            path=args.path,
            bucket_mb=args.bucket_mb,
            queue_depth=args.depth,
            block_size_kb=args.block_kb,
            durable=True,
        )
    build_s = time.perf_counter() - t0
    times = []
    io0 = opt.io_stats() if isinstance(opt, mo.AdamW) else {}
    # Warm-up steps: torch allocates its state in the first; with nvme the first steps also
    # compete with the host flushing the state files just written (a virtio disk here).
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    out = {
        "mode": args.mode,
        "build_s": build_s,
        "step_s": statistics.median(times[args.warmup :]),
        "steps_s": times[args.warmup :],
        "rss_growth": rss_bytes() - base_rss,
        "peak_rss_growth": max(0, peak_rss_bytes() - max(base_peak, base_rss)),
    }
    if isinstance(opt, mo.AdamW):
        io1 = opt.io_stats()
        steps = args.warmup + args.steps
        out.update(
            state_bytes=opt.state_bytes,
            num_buckets=opt.num_buckets,
            resident_bytes=opt.resident_bytes,
            peak_resident_bytes=opt.peak_resident_bytes,
            bucket_bytes=max(b.nbytes for b in opt._buckets),
        )
        if io1:
            out["read_per_step"] = (io1["bytes_read"] - io0["bytes_read"]) / steps
            out["written_per_step"] = (io1["bytes_written"] - io0["bytes_written"]) / steps
            out["backend"] = io1["backend"]
        opt.close()
    return out


def fio_gbps(path: str, rw: str, size: int, args: argparse.Namespace) -> float:
    cmd = [
        "fio", "--name=peer", f"--filename={path}", f"--size={size}", f"--bs={args.block_kb}k",
        f"--iodepth={args.depth}", "--direct=1", "--ioengine=io_uring", "--fixedbufs",
        f"--rw={rw}", "--output-format=json",
    ]  # fmt: skip
    # fio mallocs its buffers; this glibc tunable puts them on transparent huge pages, the
    # memory the optimizer's bucket buffers use (see tools/bench/offload_pager.py).
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    out = json.loads(proc.stdout)
    return out["jobs"][0][rw]["bw_bytes"] / 1e9


def fio_mixed_s(
    read_path: str, read_size: int, write_path: str, write_size: int, args: argparse.Namespace
) -> float:
    """Seconds for fio to read ``read_size`` bytes of one file while writing ``write_size``
    to another (two concurrent jobs, as a step keeps a read and a write in flight)."""
    common = [f"--bs={args.block_kb}k", f"--iodepth={args.depth}", "--direct=1",
              "--ioengine=io_uring", "--fixedbufs"]  # fmt: skip
    cmd = ["fio", *common, "--output-format=json",
           "--name=rd", f"--filename={read_path}", f"--size={read_size}", "--rw=read",
           "--name=wr", f"--filename={write_path}", f"--size={write_size}",
           "--rw=write"]  # fmt: skip
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    jobs = {j["jobname"]: j for j in json.loads(proc.stdout)["jobs"]}
    return max(read_size / jobs["rd"]["read"]["bw_bytes"],
               write_size / jobs["wr"]["write"]["bw_bytes"])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: TMPDIR)")
    ap.add_argument("--params-m", type=float, default=90.0, help="parameters, in millions")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--block-kb", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the update")
    ap.add_argument("--rounds", type=int, default=3, help="(nvme steps, fio) rounds")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: one mode
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode is not None:
        print(json.dumps(run_mode(args)))
        return
    tmp = tempfile.mkdtemp(dir=args.dir, prefix="miles-offload-step-")
    try:
        res: dict[str, dict] = {}
        fio_file = os.path.join(tmp, "fio.bin")
        fio_file2 = os.path.join(tmp, "fio_w.bin")

        def run(mode: str) -> dict:
            cmd = [sys.executable, __file__, "--mode", mode, "--path", os.path.join(tmp, "s")]
            for k in ("params_m", "bucket_mb", "steps", "warmup", "depth", "block_kb", "threads"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr)
            shutil.rmtree(os.path.join(tmp, "s"), ignore_errors=True)
            return json.loads(proc.stdout.strip().splitlines()[-1])

        # The disk of a VM changes speed from one minute to the next (here fio read 1.6-2.2
        # GB/s within an hour), so each round times the nvme steps and then, right after, fio
        # on the same disk: each round's efficiency compares two measurements a few seconds
        # apart, and the rounds show how much the disk moved.
        rounds = []
        for _ in range(args.rounds):
            nv = run("nvme")
            # fio moves as many bytes per job as a step reads (and writes): a sustained rate,
            # like the step's, not a burst of one bucket file (64 MiB is ~30 ms of I/O here).
            size = -(-int(nv["read_per_step"]) // 2**20) * 2**20
            # Lay the file out first: the runs below overwrite it, as every step overwrites
            # the bucket files (a first write into a new file also allocates its blocks).
            if not os.path.exists(fio_file):
                fio_gbps(fio_file, "write", size, args)
            fio_runs = []
            for _ in range(3):
                w = fio_gbps(fio_file, "write", size, args)
                fio_runs.append((w, fio_gbps(fio_file, "read", size, args)))
            fio_w = statistics.median(w for w, _ in fio_runs)
            fio_r = statistics.median(r for _, r in fio_runs)
            bound = nv["read_per_step"] / 1e9 / fio_r + nv["written_per_step"] / 1e9 / fio_w
            # The second peer: fio doing what a step does to the disk, a step's reads and its
            # writes at the same time (the pipeline keeps both in flight).
            wsize = -(-int(nv["written_per_step"]) // 2**20) * 2**20
            if not os.path.exists(fio_file2):
                fio_gbps(fio_file2, "write", wsize, args)
            mixed = statistics.median(
                fio_mixed_s(fio_file, size, fio_file2, wsize, args) for _ in range(3)
            )
            rounds.append({"nvme": nv, "fio_read": fio_r, "fio_write": fio_w, "bound": bound,
                           "efficiency": bound / nv["step_s"], "fio_mixed_s": mixed,
                           "mixed_efficiency": mixed / nv["step_s"]})  # fmt: skip
        mid = sorted(rounds, key=lambda r: r["efficiency"])[len(rounds) // 2]
        res["nvme"] = nv = mid["nvme"]
        res["cpu"] = run("cpu")
        res["torch"] = run("torch")
        gb = 1e9
        print(
            f"{args.params_m:g}M fp32 params, state {nv['state_bytes'] / gb:.2f} GB in "
            f"{nv['num_buckets']} buckets of <= {nv['bucket_bytes'] / 2**20:.0f} MiB; torch "
            f"threads {args.threads}; pager {nv['backend']}, depth {args.depth}, "
            f"{args.block_kb} KiB blocks; median of {args.steps} steps after {args.warmup} "
            f"warm-up; {args.rounds} rounds of (nvme steps, then fio)"
        )
        print(
            f"io    per step read {nv['read_per_step'] / gb:.2f} GB + written "
            f"{nv['written_per_step'] / gb:.2f} GB"
        )
        for i, r in enumerate(rounds):
            print(
                f"round {i}: nvme {r['nvme']['step_s']:.2f} s (steps "
                + ", ".join(f"{t:.2f}" for t in r["nvme"]["steps_s"])
                + f"); fio read {r['fio_read']:.2f} GB/s, write {r['fio_write']:.2f} GB/s -> "
                f"I/O bound {r['bound']:.2f} s; efficiency bound/nvme {r['efficiency']:.2f}x; "
                f"fio reading and writing together {r['fio_mixed_s']:.2f} s = "
                f"{r['mixed_efficiency']:.2f}x"
            )
        effs = sorted(r["efficiency"] for r in rounds)
        print(
            f"step  nvme {nv['step_s']:.2f} s (median round)  cpu (in RAM) "
            f"{res['cpu']['step_s']:.2f} s  torch AdamW {res['torch']['step_s']:.2f} s; "
            f"efficiency median {mid['efficiency']:.2f}x (min {effs[0]:.2f}x, max "
            f"{effs[-1]:.2f}x); nvme/cpu {nv['step_s'] / res['cpu']['step_s']:.2f}x"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rounds": rounds, "cpu": res["cpu"], "torch": res["torch"]}, f, indent=1)
        for mode in ("nvme", "cpu", "torch"):
            r = res[mode]
            acct = (
                f"pager accounting: peak {r['peak_resident_bytes'] / gb:.3f} GB in use, "
                f"{r['resident_bytes'] / gb:.3f} GB held"
                if "resident_bytes" in r
                else "no accounting"
            )
            print(
                f"mem   {mode:5s} RSS growth over params+grads: peak "
                f"{r['peak_rss_growth'] / gb:.3f} GB, after steps {r['rss_growth'] / gb:.3f} GB;"
                f" {acct}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
