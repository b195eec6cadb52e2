"""Standalone weight sync: a plain PyTorch training loop keeps two inference copies up to date.

Why this exists: miles-transfer must be usable alone inside another RL stack, with nothing but
torch installed. This script is that situation in miniature. A plain model is trained with a
plain loop; after every optimizer step its weights are pushed to

1. an in-process inference copy (a ``ModuleReceiver`` over a second model, fp32), and
2. an inference copy in a second process, reached over HTTP with SGLang's weight-update API
   (``WeightServer`` + ``HTTPReceiver``; bf16, so the sender casts before sending),

and each push is verified bit for bit against the trainer's tensors (checksums). At the end the
in-process copy must give exactly the trainer's outputs.

Run it (laptop or any machine, CPU only, a few seconds)::

    pip install torch==2.13.0 packages/miles-transfer   # or: pip install miles-transfer
    python packages/miles-transfer/examples/standalone_sync.py [--steps 20]

On a cluster nothing changes for the HTTP path except the URL: point ``HTTPReceiver`` at an
SGLang server on the same host (stock SGLang lacks ``/weights_checksum``: pass
``verify=False``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from miles_transfer import HTTPReceiver, ModuleReceiver, push_weights
from miles_transfer.push import WeightServer, iter_full_state


def make_model(seed: int) -> torch.nn.Module:
    """The policy stand-in: a small MLP (same architecture on every side)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    )


def serve() -> None:
    """Second process: serve an inference copy over HTTP until stdin closes."""
    with WeightServer(ModuleReceiver(make_model(seed=123), dtype=torch.bfloat16)) as server:
        print(server.url, flush=True)
        sys.stdin.read()  # the parent closes our stdin when it is done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-http", action="store_true", help="skip the second process")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return

    torch.manual_seed(0)
    policy = make_model(seed=0)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    x = torch.randn(256, 16)
    y = (x[:, :4].sum(dim=1, keepdim=True) * 0.5).tanh()

    local = ModuleReceiver(make_model(seed=1))  # fp32 copy in this process
    proc = None
    remote = None
    if not args.no_http:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        remote = HTTPReceiver(proc.stdout.readline().strip())

    try:
        print(f"{'step':>4} {'loss':>8} {'local sync':>11} {'http sync':>10}")
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            loss = torch.nn.functional.mse_loss(policy(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            version = str(step)
            local_report = push_weights(iter_full_state(policy), local, weight_version=version)
            http_s = "-"
            if remote is not None:
                with remote.paused():
                    report = push_weights(iter_full_state(policy), remote, weight_version=version)
                http_s = f"{report.send_seconds + report.verify_seconds:.3f}s"
            if step == 1 or step % 5 == 0 or step == args.steps:
                local_s = f"{local_report.send_seconds + local_report.verify_seconds:.3f}s"
                print(f"{step:>4} {loss.item():>8.4f} {local_s:>11} {http_s:>10}")
        elapsed = time.perf_counter() - t0

        with torch.no_grad():
            same = torch.equal(policy(x), local.module(x))
        assert same, "the in-process copy must reproduce the trainer's outputs exactly"
        targets = "in-process fp32 copy" + ("" if remote is None else " and HTTP bf16 copy")
        print(
            f"{args.steps} steps in {elapsed:.2f}s: every push to the {targets} verified "
            f"bit-exact ({local_report.tensors} tensors, {local_report.bytes} bytes each); "
            f"in-process copy outputs identical to the trainer's; weight_version "
            f"{local.weight_version}"
        )
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
