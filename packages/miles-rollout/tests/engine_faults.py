"""Fault injection for server tests: a stalled engine, waits on conditions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from miles_rollout import Engine

__all__ = ["barrier", "stalled", "wait_until"]


@contextmanager
def stalled(engine: Engine) -> Iterator[None]:
    """Park every scheduler thread of ``engine`` until the block ends: a control call that
    does not return is how a stuck engine looks from outside (requests queue, none runs)."""
    gate = threading.Event()
    parked = []
    for rank in engine._ranks:
        entered = threading.Event()

        def park(entered: threading.Event = entered) -> None:
            entered.set()
            gate.wait()

        parked.append(rank.scheduler.post(park))
        assert entered.wait(60)
    try:
        yield
    finally:
        gate.set()
        for fut in parked:
            fut.result(timeout=60)


def barrier(engine: Engine) -> None:
    """Return once each scheduler has gone through two more loop iterations (everything queued
    before has been drained, and cancelled requests dropped)."""
    for rank in engine._ranks:
        rank.scheduler.call(lambda: None)
        rank.scheduler.call(lambda: None)


def wait_until(cond: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
