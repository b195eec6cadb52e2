"""wait_for_gloo_workers: a worker counts as parked only once it has stopped being scheduled.

The threads here stand in for torch's gloo workers by taking a name of their own (their
/proc comm), so real gloo threads of this process cannot interfere. The 2-rank FSDP2 run in
test_state.py ends with shutdown_process_group on real gloo workers.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from miles_transfer.dist import shutdown_process_group, wait_for_gloo_workers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

NAME = "miles_test_gloo"


class _Named(threading.Thread):
    """A thread renamed to NAME (as the kernel sees it) that then runs `body(stop)`."""

    def __init__(self, body: Callable[[threading.Event], None]) -> None:
        super().__init__(daemon=True)
        self.body, self.stop, self.named = body, threading.Event(), threading.Event()

    def run(self) -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(NAME)
        self.named.set()
        self.body(self.stop)


@pytest.fixture
def named() -> Iterator[Callable[[Callable[[threading.Event], None]], _Named]]:
    threads: list[_Named] = []

    def start(body: Callable[[threading.Event], None]) -> _Named:
        t = _Named(body)
        t.start()
        assert t.named.wait(5)
        threads.append(t)
        return t

    yield start
    for t in threads:
        t.stop.set()
        t.join(5)


def _busy_then_parked(
    busy: Callable[[threading.Event], None], done: threading.Event
) -> Callable[[threading.Event], None]:
    def body(stop: threading.Event) -> None:
        busy(stop)
        done.set()
        stop.wait()  # parked: blocked with no timeout

    return body


def _wake_every_ms(seconds: float) -> Callable[[threading.Event], None]:
    """Sleep 1 ms at a time for `seconds` (a thread waiting for the GIL wakes every 5 ms)."""

    def busy(stop: threading.Event) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            time.sleep(0.001)

    return busy


def _spin(cpu_seconds: float) -> Callable[[threading.Event], None]:
    """Run (state R) until this thread has used `cpu_seconds` of CPU time."""

    def busy(stop: threading.Event) -> None:
        end = time.thread_time() + cpu_seconds
        while time.thread_time() < end:
            pass

    return busy


def test_no_worker_threads_returns_at_once() -> None:
    t0 = time.monotonic()
    assert wait_for_gloo_workers(timeout=120.0, _name="no_such_thread")
    assert time.monotonic() - t0 < 60.0  # did not wait out its timeout (no tight bound: CI load)


def test_a_worker_blocked_without_timeout_is_parked(named) -> None:
    named(lambda stop: stop.wait())
    assert wait_for_gloo_workers(timeout=5.0, _name=NAME)


@pytest.mark.parametrize("busy", [_wake_every_ms(0.3), _spin(0.3)], ids=["waking", "running"])
def test_a_busy_worker_is_not_parked_until_it_stops(named, busy) -> None:
    done = threading.Event()
    named(_busy_then_parked(busy, done))
    assert wait_for_gloo_workers(timeout=30.0, _name=NAME)
    assert done.is_set()  # it returned only once the thread had finished its work


def test_times_out_on_a_worker_that_never_parks(named) -> None:
    named(_busy_then_parked(_wake_every_ms(3600), threading.Event()))
    t0 = time.monotonic()
    assert not wait_for_gloo_workers(timeout=0.2, _name=NAME)
    assert time.monotonic() - t0 >= 0.2


def test_shutdown_without_a_group_is_a_no_op() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("another test left a default process group")
    assert shutdown_process_group(timeout=1.0)
    assert not dist.is_initialized()
