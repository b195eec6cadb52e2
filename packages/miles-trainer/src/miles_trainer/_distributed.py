"""The process group every backend trains in: join or create it, destroy it safely at exit.

Shared by the FSDP2 and Megatron backends (both run one process per device under torchrun,
gloo on CPU and NCCL on CUDA).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist

from miles_trainer._gloo_exit import wait_for_gloo_workers

__all__ = ["broadcast_ok", "init_distributed"]

# How long the atexit handler below waits at most for gloo's worker threads to park.
_EXIT_WAIT_S = 5.0


def _destroy_own_group(group: Any) -> None:
    """atexit: wait until gloo's worker threads are parked, then destroy the group
    `init_distributed` made.

    A gloo worker thread frees each finished collective's tensors after the caller's `wait()`
    has returned; freeing a tensor whose Python object is gone takes the GIL. When the process
    exits right after its last collective, that thread may get the GIL only once interpreter
    teardown has begun, and CPython then ends it with pthread_exit, whose unwinding through
    torch's C++ frames calls std::terminate: the process aborts at exit ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489; 4 of 62 runs of the 2-rank
    QAT test on a loaded 2-core machine). Waiting here, before teardown and with the GIL
    released, until those threads sleep unscheduled (`_gloo_exit`) lets them finish; destroying
    the group afterwards shuts its backend down. A group the caller created (or replaced since)
    is the caller's to destroy.
    """
    if dist.is_initialized() and dist.group.WORLD is group:
        wait_for_gloo_workers(_EXIT_WAIT_S)
        dist.destroy_process_group()


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or create) the default process group; return (rank, world size, device).

    Under a launcher (``RANK`` and ``WORLD_SIZE`` set) it uses env:// rendezvous; without one
    it makes a private one-process group (no port). A group created here is destroyed at
    interpreter exit (`_destroy_own_group`).
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)  # launched by torchrun (env:// rendezvous)
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
        atexit.register(_destroy_own_group, dist.group.WORLD)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def broadcast_ok(ok: bool, device: torch.device) -> bool:
    """Rank 0's ``ok`` on every rank (so a failed write on rank 0 fails every rank)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
