"""Leave a gloo process group so that the process can exit without aborting.

torch's gloo backend runs each collective on a worker thread ("pt_gloo_runloop"), which drops
its references to the collective's tensors only after the caller's ``wait()`` has returned. If
the caller's Python objects for those tensors are already gone, dropping the last reference
takes the GIL. A process that exits right after its last collective can reach interpreter
teardown before that thread has run; CPython then ends the thread with ``pthread_exit`` when it
asks for the GIL, the unwinding crosses torch's C++ frames, and the process dies with
"terminate called without an active exception" (SIGABRT) after its work succeeded
(pytorch/pytorch#190489). ``torch.distributed.destroy_process_group()`` does not join those
threads while FSDP or a DeviceMesh still holds the group.

`wait_for_gloo_workers` blocks, with the GIL released, until every gloo worker thread is parked
waiting for work; `shutdown_process_group` does that and then destroys the default group. Call
the latter last in a process (a ``torchrun`` or ``mp.spawn`` worker) that used gloo.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

__all__ = ["shutdown_process_group", "wait_for_gloo_workers"]

_TASKS = "/proc/self/task"
_WORKER_NAME = "pt_gloo_runloop"  # torch names its gloo worker threads so (torch >= 2.6 on Linux)
_POLL_S = 0.01
_QUIET_POLLS = 2  # consecutive unchanged polls that prove a worker is parked
_FALLBACK_S = 0.05  # no /proc (not Linux): release the GIL this long instead


def _worker_snapshot(name: str) -> dict[str, tuple[str, int]] | None:
    """{tid: (state, context switches)} of this process's threads called `name`.

    None where /proc cannot tell (not Linux).
    """
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    snap: dict[str, tuple[str, int]] = {}
    for tid in tids:
        base = f"{_TASKS}/{tid}"
        try:
            with open(f"{base}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"{base}/status") as f:
                status = f.read()
        except OSError:  # the thread ended between listdir and open
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        switches = int(fields["voluntary_ctxt_switches"]) + int(
            fields["nonvoluntary_ctxt_switches"]
        )
        snap[tid] = (fields["State"].split()[0], switches)
    return snap


def wait_for_gloo_workers(timeout: float = 5.0, *, _name: str = _WORKER_NAME) -> bool:
    """Wait, with the GIL released, until torch's gloo worker threads are parked for good.

    A worker is parked when it sleeps (state S) and has not been scheduled at all across
    `_QUIET_POLLS` polls 10 ms apart: a worker still cleaning up a collective is running or
    runnable, and one waiting for the GIL wakes every few milliseconds to ask for it. Returns
    True once all are parked (or there are none), False if `timeout` seconds pass first. Where
    /proc is not available it sleeps 50 ms and returns False.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    prev = _worker_snapshot(_name)
    if prev is None:
        time.sleep(_FALLBACK_S)
        return False
    while prev:
        time.sleep(_POLL_S)  # releases the GIL to any worker that is waiting for it
        cur = _worker_snapshot(_name)
        assert cur is not None
        parked = cur == prev and all(state == "S" for state, _ in cur.values())
        quiet = quiet + 1 if parked else 0
        if quiet >= _QUIET_POLLS:
            return True
        if time.monotonic() >= deadline:
            return False
        prev = cur
    return True


def shutdown_process_group(timeout: float = 5.0) -> bool:
    """`wait_for_gloo_workers`, then ``torch.distributed.destroy_process_group()``.

    The last call of a process that used a gloo group (a no-op wait for NCCL-only processes;
    nothing to destroy if no group is initialized). Returns `wait_for_gloo_workers`'s result.
    """
    quiet = wait_for_gloo_workers(timeout)
    if dist.is_initialized():
        dist.destroy_process_group()
    return quiet
