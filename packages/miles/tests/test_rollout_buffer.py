"""The async rollout's buffer and staleness rules, without engines."""

from __future__ import annotations

import threading
import time

import pytest

from miles.rollout.buffer import (
    CompletedGroup,
    GroupBuffer,
    GroupView,
    decide_staleness,
    group_min_version,
    token_versions,
)
from miles_rollout import PromptItem, Sample


def _sample(versions: list[str | None], mask: list[int] | None = None) -> Sample:
    n = len(versions)
    return Sample(
        group_index=0,
        index=0,
        prompt="p",
        tokens=[1, 2, *range(n)],
        response_length=n,
        loss_mask=mask if mask is not None else [1] * n,
        rollout_logprobs=[0.0] * n,
        weight_versions=versions,
        reward=1.0,
    )


def _group(*samples: Sample) -> CompletedGroup:
    item = PromptItem(messages=[{"role": "user", "content": "1+1="}], label=2)
    return CompletedGroup(item=item, samples=list(samples), retries=0, completed_at=0.0)


def test_token_versions_skip_tokens_the_policy_did_not_generate() -> None:
    s = _sample(["3", "3", None, "4"], mask=[1, 1, 0, 1])
    assert token_versions(s) == [3, 3, None, 4]
    # A partial rollout: the oldest generated token decides the group's staleness.
    assert group_min_version([s, _sample(["5", "5"])]) == 3


def test_group_view_staleness_is_trainer_version_minus_oldest_token() -> None:
    view = _group(_sample(["2", "3"]), _sample(["3"])).view(trainer_version=5)
    assert (view.staleness, view.min_version, view.max_version) == (3, 2, 3)
    assert view.rewards == (1.0, 1.0)


def _view(staleness: int) -> GroupView:
    return _group(_sample([str(10 - staleness)])).view(trainer_version=10)


@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_builtin_policies_apply_only_over_the_bound(policy: str) -> None:
    kw = {"max_staleness": 1, "policy": policy, "fn": None, "fallback": "keep"}
    assert decide_staleness(_view(1), **kw) == ("keep", False)
    assert decide_staleness(_view(2), **kw) == (policy, False)
    # reject decides at put time, so a group that made it into the buffer is kept.
    assert decide_staleness(_view(5), **{**kw, "policy": "reject"}) == ("keep", False)


def test_user_rule_sees_the_group_and_a_raising_rule_falls_back() -> None:
    seen: list[GroupView] = []

    def rule(view: GroupView) -> str:
        seen.append(view)
        return "retry" if view.staleness == 2 else "drop"

    kw = {"max_staleness": 0, "policy": "mod:rule", "fallback": "keep"}
    assert decide_staleness(_view(2), fn=rule, **kw) == ("retry", False)
    assert decide_staleness(_view(3), fn=rule, **kw) == ("drop", False)
    assert [v.staleness for v in seen] == [2, 3]

    def broken(view: GroupView) -> str:
        raise KeyError("boom")

    assert decide_staleness(_view(2), fn=broken, **kw) == ("keep", True)
    with pytest.raises(ValueError, match="returned 'maybe'"):
        decide_staleness(_view(2), fn=lambda v: "maybe", **kw)


def test_buffer_is_fifo_bounded_and_wakes_a_waiting_consumer() -> None:
    buf = GroupBuffer(capacity=2)
    g1, g2 = _group(_sample(["0"])), _group(_sample(["1"]))
    got: list[CompletedGroup] = []
    consumer = threading.Thread(target=lambda: got.append(buf.get(timeout=30)))
    consumer.start()
    buf.put(g1)
    consumer.join(timeout=30)
    assert got == [g1]
    buf.put(g2)
    assert buf.has_room()
    buf.put(g1)
    assert not buf.has_room()  # producers stop starting groups
    assert buf.get() is g2
    assert buf.get() is g1
    with pytest.raises(TimeoutError):
        buf.get(timeout=0.05)


def test_buffer_reports_a_dead_producer_to_the_consumer() -> None:
    buf = GroupBuffer(capacity=1)
    t = threading.Timer(0.05, lambda: buf.fail(OSError("engine gone")))
    t.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="engine gone"):
        buf.get(timeout=30)
    assert time.monotonic() - t0 < 30
