"""Pager bandwidth: miles_offload.Pager vs fio running the same job on the same disk.

Why: NVMe optimizer offload is only as fast as its pager. The peer is fio with the same file
size, block size, queue depth, O_DIRECT, engine (io_uring) and registered buffers, reading and
writing one file sequentially; the pager moves one pre-faulted, registered bucket-sized buffer
per call, the way `miles_offload.AdamW` does. Runs alternate (fio, pager, fio, pager, ...) so
that both see the same disk conditions; the report gives medians and the pager/fio ratio
(target >= 0.9).

Laptop:   python tools/bench/offload_pager.py                       # ~1 min, 512 MiB file
          python tools/bench/offload_pager.py --size-mb 256 --depth 64 --block-kb 256
Cluster:  python tools/bench/offload_pager.py --dir /local_nvme/tmp --size-mb 4096
Needs fio (apt-get install fio) and the pager built with liburing (make setup).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import miles_offload as mo


def fio_gbps(path: str, rw: str, args: argparse.Namespace) -> float:
    cmd = [
        "fio",
        "--name=peer",
        f"--filename={path}",
        f"--size={args.size_mb}M",
        f"--bs={args.block_kb}k",
        f"--iodepth={args.depth}",
        "--direct=1",
        "--ioengine=io_uring",
        "--fixedbufs",  # registered buffers, as the pager uses
        f"--rw={rw}",
        "--numjobs=1",
        "--output-format=json",
    ]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return out["jobs"][0][rw.removeprefix("seq")]["bw_bytes"] / 1e9


def pager_gbps(pager: mo.Pager, fd: int, buf, rw: str) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    (pager.write if rw == "write" else pager.read)(fd, 0, buf)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: TMPDIR)")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--block-kb", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backend", default="io_uring", choices=["io_uring", "threads", "python"])
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio not found: apt-get install fio")
    tmp = tempfile.mkdtemp(dir=args.dir, prefix="miles-offload-bench-")
    path = os.path.join(tmp, "pager.bin")
    try:
        pager = mo.Pager(
            queue_depth=args.depth, block_size=args.block_kb * 1024, backend=args.backend
        )
        buf = mo.aligned_empty(args.size_mb << 20)  # pre-faulted (zero-filled) once
        buf.random_(0, 256)
        registered = pager.register([buf])
        fd, direct = mo.open_direct(path, create=True)
        assert direct, "the benchmark directory must support O_DIRECT"
        pager.write(fd, 0, buf)  # lay the file out once
        res: dict[str, list[float]] = {k: [] for k in ("fio_w", "pager_w", "fio_r", "pager_r")}
        for _ in range(args.repeat):
            res["fio_w"].append(fio_gbps(path, "write", args))
            res["pager_w"].append(pager_gbps(pager, fd, buf, "write"))
            res["fio_r"].append(fio_gbps(path, "read", args))
            res["pager_r"].append(pager_gbps(pager, fd, buf, "read"))
        os.close(fd)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(
            f"job: {args.size_mb} MiB file, {args.block_kb} KiB blocks, depth {args.depth}, "
            f"O_DIRECT, sequential; pager backend {pager.backend} (registered: {registered}); "
            f"{args.repeat} alternating runs, medians"
        )
        for rw, name in (("w", "write"), ("r", "read")):
            runs = ", ".join(
                f"{a:.2f}/{b:.2f}" for a, b in zip(res[f"pager_{rw}"], res[f"fio_{rw}"])
            )
            print(
                f"{name:5s}  pager {med[f'pager_{rw}']:.2f} GB/s  fio {med[f'fio_{rw}']:.2f} GB/s"
                f"  ratio {med[f'pager_{rw}'] / med[f'fio_{rw}']:.2f}x   (runs pager/fio: {runs})"
            )
        print("stats", pager.stats())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
