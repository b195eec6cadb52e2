"""Wait, before interpreter teardown, until torch's gloo worker threads are parked.

A gloo worker ("pt_gloo_runloop") drops a finished collective's tensors after the caller's
``wait()`` has returned; dropping one whose Python object is gone takes the GIL. If that happens
during interpreter teardown, CPython ends the thread with ``pthread_exit``, the unwinding
crosses torch's C++ frames, and the process aborts ("terminate called without an active
exception"; pytorch/pytorch#190489). miles-transfer offers the same wait publicly
(``miles_transfer.wait_for_gloo_workers``); the trainer does not depend on it.
"""

from __future__ import annotations

import os
import time

_TASKS = "/proc/self/task"


def _gloo_workers() -> dict[str, tuple[str, int]] | None:
    """{tid: (state, context switches)} of the gloo worker threads; None without /proc."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"{_TASKS}/{tid}/status") as f:
                kv = dict(ln.split(":\t", 1) for ln in f.read().splitlines() if ":\t" in ln)
        except OSError:
            continue
        switches = int(kv["voluntary_ctxt_switches"]) + int(kv["nonvoluntary_ctxt_switches"])
        out[tid] = (kv["State"].split()[0], switches)
    return out


def wait_for_gloo_workers(timeout: float) -> bool:
    """True once every gloo worker sleeps unscheduled across two 10 ms polls (GIL released).

    A worker still releasing tensors runs or wakes (a GIL waiter wakes every 5 ms). False when
    `timeout` passes first, or where /proc is missing (after a plain 50 ms sleep).
    """
    deadline = time.monotonic() + timeout
    prev = _gloo_workers()
    if prev is None:
        time.sleep(0.05)
        return False
    quiet = 0
    while prev:
        time.sleep(0.01)
        cur = _gloo_workers() or {}
        quiet = quiet + 1 if cur == prev and all(s == "S" for s, _ in cur.values()) else 0
        if quiet >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        prev = cur
    return True
