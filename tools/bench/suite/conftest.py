"""pytest-benchmark suite: each of our hot paths beside its named peer or physical limit.

Run it with ``make bench`` (JSON under runs/bench/), or
``pytest tools/bench/suite -o python_files='bench_*.py' --benchmark-only
--benchmark-group-by=group``. Files are named ``bench_*.py`` so that no test run collects them
(``make test``, ``pytest tests``, Pants' ``test_*.py`` globs); docs/benchmarks.md has the
figures. Every benchmark in a group runs on the same pre-faulted buffers, one thread, so a
group's rows compare like for like; the summary prints each row's time as a multiple of the
group's memcpy (``PEER``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

# The row every other row of a group is divided by (its physical limit: a memcpy of the input).
PEER = "memcpy"


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the shared 2-core CI machine gives nothing stable beyond that."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    """Each group's rows as multiples of the group's memcpy (min times; lower is better)."""
    session = getattr(config, "_benchmarksession", None)
    benches = getattr(session, "benchmarks", None) or []
    groups: dict[str, dict[str, float]] = {}
    for b in benches:
        stats = getattr(b, "stats", None)
        if stats is None or not getattr(stats, "rounds", 0):
            continue
        groups.setdefault(b.group or "", {})[b.param or b.name] = stats.min
    if not groups:
        return
    terminalreporter.section("ratios to the group's memcpy (min time / memcpy min time)")
    for group, rows in sorted(groups.items()):
        peer = rows.get(PEER)
        cells = [f"{name} {t / peer:.2f}x" if peer else f"{name} {t * 1e3:.3f} ms"
                 for name, t in sorted(rows.items(), key=lambda kv: kv[1])]  # fmt: skip
        terminalreporter.write_line(f"{group}: " + ", ".join(cells))
