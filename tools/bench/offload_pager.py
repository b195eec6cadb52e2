"""Pager bandwidth: miles_offload.Pager vs fio running the same job on the same disk.

Why: NVMe optimizer offload is only as fast as its pager. The peer is fio with the same file
size, block size, queue depth, O_DIRECT, engine (io_uring) and registered buffers, reading and
writing one file sequentially; the pager moves one pre-faulted, registered bucket-sized buffer
per call, the way `miles_offload.AdamW` does. Both overwrite a file that is laid out once
beforehand, as AdamW overwrites its bucket files at every step (fio writes over an existing
file without laying it out again). Runs alternate (fio, pager, fio, pager, ...) so that both
see the same disk conditions; the report gives medians and the pager/fio ratio (target >= 0.9).

The memory behind the buffers matters as much as the I/O engine: a transfer needs one DMA
segment per physically contiguous piece of the buffer, and on the project's VMs O_DIRECT
writes from fragmented 4 KiB pages ran at 2.2 GB/s where the same pager wrote 3.3-3.5 GB/s
from contiguous memory. `mo.aligned_empty` therefore puts large buffers on transparent huge
pages, and fio gets the same kind of memory (glibc's ``glibc.malloc.hugetlb=1`` tunable makes
its malloc'ed buffers huge-page backed). Both sides also run on ordinary 4 KiB pages
(fio's default; for the pager, the allocation it made before), where the result depends on
how fragmented the memory each run draws happens to be. The pager's huge-page buffer is
allocated once and reused, as AdamW allocates its bucket buffers once (allocating one right
before a transfer cost about 4% in an A/B); its 4 KiB-page buffer is new for every run
(allocated, pre-faulted and registered outside the timed part), as fio allocates its buffers
in every new process, so both sample the fragmentation lottery. ``--same-buffer`` reuses one
4 KiB-page buffer too, ``--fresh-huge`` allocates a new huge-page buffer for every run.

Laptop:   python tools/bench/offload_pager.py                       # ~2 min, 512 MiB file
          python tools/bench/offload_pager.py --size-mb 256 --depth 64 --block-kb 256
Cluster:  python tools/bench/offload_pager.py --dir /local_nvme/tmp --size-mb 4096
Needs fio (apt-get install fio), glibc >= 2.35 for fio's huge-page buffers, and the pager
built with liburing (make setup).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import tempfile
import time

import torch

import miles_offload as mo

KINDS = ("huge", "4k")  # buffer memory: transparent huge pages, ordinary 4 KiB pages


def fio_gbps(path: str, rw: str, kind: str, args: argparse.Namespace) -> float:
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
    env = dict(os.environ)
    if kind == "huge":  # fio mallocs its buffers (iomem=malloc); glibc then advises huge pages
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout)["jobs"][0][rw]["bw_bytes"] / 1e9


def small_page_empty(nbytes: int) -> torch.Tensor:
    """A pre-faulted, page-aligned buffer on ordinary pages (aligned_empty before huge pages)."""
    raw = torch.empty(nbytes + mo.ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % mo.ALIGN
    out = raw[skip : skip + nbytes]
    out.zero_()
    return out


def fresh_buffer(nbytes: int, kind: str, pattern: torch.Tensor) -> torch.Tensor:
    """A new pre-faulted buffer filled with ``pattern`` (random bytes, like fio's)."""
    buf = mo.aligned_empty(nbytes) if kind == "huge" else small_page_empty(nbytes)
    buf.view(-1, pattern.numel()).copy_(pattern)
    return buf


def pieces_per_mib(buf: torch.Tensor) -> float | None:
    """Physically contiguous pieces per MiB of ``buf`` (from /proc/self/pagemap; root only)."""
    pages = buf.numel() // mo.ALIGN
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(buf.data_ptr() // mo.ALIGN * 8)
            raw = f.read(pages * 8)
    except OSError:
        return None
    pfn = [e & ((1 << 55) - 1) for e in struct.unpack(f"{pages}Q", raw)]
    if not any(pfn):  # PFNs are hidden from unprivileged processes
        return None
    pieces = 1 + sum(1 for a, b in itertools.pairwise(pfn) if b != a + 1)
    return pieces / (buf.numel() / (1 << 20))


def pager_gbps(pager: mo.Pager, fd: int, buf: torch.Tensor, rw: str) -> float:
    t0 = time.perf_counter()
    (pager.write if rw == "write" else pager.read)(fd, 0, buf)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: TMPDIR)")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--block-kb", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backend", default="io_uring", choices=["io_uring", "threads", "python"])
    ap.add_argument(
        "--same-buffer", action="store_true", help="reuse one 4 KiB-page buffer for every run"
    )
    ap.add_argument(
        "--fresh-huge", action="store_true", help="a new huge-page buffer for every run"
    )
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio not found: apt-get install fio")
    nbytes = args.size_mb << 20
    # fio fills its depth x block buffers with random bytes once; the pager's buffers repeat a
    # random block of that size.
    pattern = torch.randint(
        0, 256, (math.gcd(nbytes, args.depth * args.block_kb * 1024),), dtype=torch.uint8
    )
    tmp = tempfile.mkdtemp(dir=args.dir, prefix="miles-offload-bench-")
    path = os.path.join(tmp, "pager.bin")
    try:
        pager = mo.Pager(
            queue_depth=args.depth, block_size=args.block_kb * 1024, backend=args.backend
        )
        fd, direct = mo.open_direct(path, create=True)
        assert direct, "the benchmark directory must support O_DIRECT"
        reuse = {"huge": not args.fresh_huge, "4k": args.same_buffer}
        kept = {k: fresh_buffer(nbytes, k, pattern) for k in KINDS if reuse[k]}
        layout = kept["huge"] if "huge" in kept else fresh_buffer(nbytes, "huge", pattern)
        pager.write(fd, 0, layout)  # lay the file out once: every run below overwrites it
        del layout
        res: dict[str, list[float]] = {}
        pieces: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(args.repeat):
            for rw in ("write", "read"):
                for kind in KINDS:
                    res.setdefault(f"fio {rw} {kind}", []).append(fio_gbps(path, rw, kind, args))
                    buf = kept.get(kind)
                    if buf is None:
                        buf = fresh_buffer(nbytes, kind, pattern)
                    if not pager.register([buf]):
                        raise SystemExit("the kernel refused to register the buffer (memlock)")
                    res.setdefault(f"pager {rw} {kind}", []).append(pager_gbps(pager, fd, buf, rw))
                    if (n := pieces_per_mib(buf)) is not None:
                        pieces[kind].append(n)
                    pager.register([])  # unpin; a fresh buffer is freed here
                    del buf
        os.close(fd)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(
            f"job: {args.size_mb} MiB file, {args.block_kb} KiB blocks, depth {args.depth}, "
            f"O_DIRECT, sequential overwrite; pager backend {pager.backend}; "
            "pager buffers: "
            + ", ".join(f"{k} {'reused' if reuse[k] else 'new every run'}" for k in KINDS)
            + f"; {args.repeat} alternating runs, medians"
        )
        for rw in ("write", "read"):
            for kind in KINDS:
                p, f = med[f"pager {rw} {kind}"], med[f"fio {rw} {kind}"]
                runs = ", ".join(
                    f"{a:.2f}/{b:.2f}"
                    for a, b in zip(res[f"pager {rw} {kind}"], res[f"fio {rw} {kind}"])
                )
                label = "huge pages" if kind == "huge" else "4 KiB pages"
                print(
                    f"{rw:5s} {label:11s} pager {p:.2f} GB/s  fio {f:.2f} GB/s  ratio {p / f:.2f}x"
                    f"   (runs pager/fio: {runs})"
                )
        for kind in KINDS:
            if pieces[kind]:
                print(
                    f"pager buffers on {kind} pages: {min(pieces[kind]):.1f}-"
                    f"{max(pieces[kind]):.1f} physically contiguous pieces per MiB"
                )
        print("stats", pager.stats())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
