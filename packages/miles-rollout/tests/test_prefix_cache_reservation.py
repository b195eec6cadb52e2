"""KV reservation for live sessions: admission control, the eviction policy, TTL, engine hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_rollout import EngineConfig, SamplingParams
from miles_rollout._prefix_cache import RadixCache


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _write(start: int, slots: torch.Tensor) -> None:
    pass


def _seq(base: int, n: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def test_reservations_survive_other_traffic_and_admission_keeps_room() -> None:
    clock = _Clock()
    tree = RadixCache(100, session_ttl_s=50.0, reserve_fraction=0.9, now=clock)
    a = _seq(1, 30)
    tree.insert(a, _write, session="A")
    assert tree.reserve("A", a, growth=30)  # 30 reserved + 30 kept for its next turn <= 90
    b = _seq(2, 30)
    tree.insert(b, _write, session="B")
    # 30 + 30 (A) + 30 + 30 (B) > 90: B is refused and stays an ordinary LRU entry.
    assert not tree.reserve("B", b, growth=30)
    assert tree.stats.reservations_refused == 1
    assert tree.stats.reserved_tokens == 30
    # Other traffic evicts B and its own older entries, never A.
    for k in range(3, 7):
        tree.insert(_seq(k, 60 - 10 * (k % 2)), _write)
        assert tree.match(a)[0] == 30
    assert tree.match(b)[0] == 0
    assert tree.stats.cached_tokens <= 100
    # A's next turn grows its path; the reservation moves with it.
    a2 = [*a, *_seq(9, 40)]
    assert tree.insert(a2, _write, session="A") == 40
    assert tree.reserve("A", a2, growth=40)
    assert tree.stats.reserved_tokens == 70
    assert tree.stats.sessions == 1
    # A request that does not fit in the unreserved room is cut to what fits.
    assert tree.insert(_seq(10, 50), _write) == 30
    assert tree.match(a2)[0] == 70
    # Idle past the TTL, the reservation expires and A's entries become evictable.
    clock.t = 100.0
    assert tree.insert(_seq(11, 60), _write) == 60
    assert tree.stats.reservations_expired == 1
    assert tree.stats.sessions == 0
    assert tree.match(a2)[0] < 70


def test_a_growing_session_takes_room_from_the_reservation_idle_longest() -> None:
    clock = _Clock()
    tree = RadixCache(100, reserve_fraction=1.0, now=clock)
    sessions = {name: _seq(i + 1, 20) for i, name in enumerate("ABC")}
    for name, toks in sessions.items():
        clock.t += 1
        tree.insert(toks, _write, session=name)
        assert tree.reserve(name, toks, growth=5)
    clock.t += 1
    tree.touch("A")  # A's next turn started: B is now the idle-longest
    grown = [*sessions["C"], *_seq(7, 50)]
    assert tree.insert(grown, _write, session="C") == 50
    assert tree.stats.reservations_dropped == 1
    assert tree.reserved_sessions() == ["C", "A"]  # idle longest first
    assert tree.match(sessions["A"])[0] == 20
    assert tree.match(sessions["B"])[0] == 0
    tree.flush()
    assert tree.stats.reserved_tokens == 0
    assert tree.stats.sessions == 0


@pytest.mark.parametrize("reservation", [True, False])
def test_engine_keeps_a_session_cached_between_turns_under_pressure(
    model_dir: Path, reservation: bool
) -> None:
    """A session's turn 2 hits its whole history although other requests filled the cache in
    between; without reservation LRU evicted it."""
    cfg = EngineConfig(
        model_path=str(model_dir), prefix_cache_tokens=120, session_reservation=reservation
    )
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1)
    p1 = [(5 * i + 7) % 90 + 3 for i in range(40)]
    with cfg.build() as eng:
        turn1 = eng.generate(p1, params, routing_key="sess")
        for k in range(4):  # other traffic, no session key
            eng.generate([(11 * i + k) % 90 + 3 for i in range(45)], params)
        turn2 = eng.generate(p1 + turn1.output_ids + [4, 4], params, routing_key="sess")
        state = eng.server_info()["internal_states"][0]
    if reservation:
        assert turn2.cached_tokens == len(p1) + 5
        assert state["prefix_cache_sessions"] == 1
        assert state["prefix_cache_reserved_tokens"] == len(p1) + 6 + 2 + 5  # turn 2 stored
    else:
        assert turn2.cached_tokens == 0
        assert state["prefix_cache_sessions"] == 0
