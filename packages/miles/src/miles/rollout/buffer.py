"""The bounded buffer of completed groups and the staleness rules applied to them."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from miles_rollout import PromptItem, Sample

__all__ = [
    "STALENESS_DECISIONS",
    "STALENESS_POLICIES",
    "CompletedGroup",
    "GroupBuffer",
    "GroupView",
    "decide_staleness",
    "group_min_version",
    "token_versions",
]

logger = logging.getLogger(__name__)

Decision = Literal["keep", "retry", "drop"]
STALENESS_DECISIONS: tuple[str, ...] = ("keep", "retry", "drop")
"""What a staleness rule may decide for a group over the bound."""
STALENESS_POLICIES: tuple[str, ...] = ("keep", "retry", "drop", "reject")
"""Built-in policies: the decisions at ``get``, or ``reject`` (refused at ``put``)."""


def token_versions(sample: Sample) -> list[int | None]:
    """The weight version of each response token (``None`` where the model did not generate it).

    Reads ``sample.weight_versions`` (one per response token; empty means unknown, then the
    sample's ``weight_version`` stands for every generated token).
    """
    n = sample.response_length
    per_token = sample.weight_versions or [sample.weight_version] * n
    mask = sample.loss_mask or [1] * n
    return [int(v) if (m and v is not None) else None for v, m in zip(per_token, mask)]


def group_min_version(group: Sequence[Sample]) -> int | None:
    """The oldest weight version that produced a token of the group (``None``: no tokens)."""
    versions = [v for s in group for v in token_versions(s) if v is not None]
    return min(versions) if versions else None


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupView:
    """What a user staleness rule sees of a group (``rollout.staleness_policy: pkg.mod:fn``).

    Attributes:
        staleness: trainer version minus the oldest token version in the group.
        trainer_version: the weights the trainer holds now (completed updates).
        min_version: the oldest weight version that produced one of the group's tokens.
        max_version: the newest one.
        rewards: the samples' rewards.
        response_lengths: the samples' response lengths.
        retries: how many times this prompt was already regenerated.
        prompt: the prompt (chat messages or text).
    """

    staleness: int
    trainer_version: int
    min_version: int
    max_version: int
    rewards: tuple[float | None, ...]
    response_lengths: tuple[int, ...]
    retries: int
    prompt: Any


StalenessFn = Callable[[GroupView], str]


def decide_staleness(
    view: GroupView,
    *,
    max_staleness: int,
    policy: str,
    fn: StalenessFn | None,
    fallback: str,
) -> tuple[str, bool]:
    """What happens to a group taken for training: ``("keep" | "retry" | "drop", fn_failed)``.

    A group within ``max_staleness`` is kept. Over it, the built-in ``policy`` decides
    (``reject`` keeps: rejection happens when the group completes), or the user ``fn``; when
    ``fn`` raises, the failure is logged with the group and ``fallback`` decides.

    Raises:
        ValueError: ``fn`` returned something other than a decision.
    """
    if view.staleness <= max_staleness or policy in ("keep", "reject"):
        return "keep", False
    if fn is None:
        return policy, False
    try:
        decision = fn(view)
    except Exception as e:
        logger.warning(
            "staleness rule %s raised %r on a group (staleness %d, versions %d..%d, prompt "
            "%.60r); using the fallback %r",
            policy,
            e,
            view.staleness,
            view.min_version,
            view.max_version,
            view.prompt,
            fallback,
        )
        return fallback, True
    if decision not in STALENESS_DECISIONS:
        raise ValueError(
            f"staleness rule {policy} returned {decision!r}; it must return one of "
            f"{list(STALENESS_DECISIONS)}"
        )
    return decision, False


@dataclass(kw_only=True, slots=True)
class CompletedGroup:
    """A finished group waiting in the buffer."""

    item: PromptItem
    samples: list[Sample]
    retries: int
    completed_at: float

    def view(self, trainer_version: int) -> GroupView:
        """The group as a user rule sees it at ``trainer_version``."""
        versions = [v for s in self.samples for v in token_versions(s) if v is not None]
        lo = min(versions) if versions else trainer_version
        hi = max(versions) if versions else trainer_version
        return GroupView(
            staleness=trainer_version - lo,
            trainer_version=trainer_version,
            min_version=lo,
            max_version=hi,
            rewards=tuple(s.reward for s in self.samples),
            response_lengths=tuple(s.response_length for s in self.samples),
            retries=self.retries,
            prompt=self.item.messages,
        )


class GroupBuffer:
    """Completed groups in completion order, bounded by ``capacity`` (thread-safe).

    Producers ask ``has_room()`` before starting new groups (backpressure); groups already in
    flight may still land, so the buffer holds at most ``capacity`` plus the groups in flight.
    """

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self._groups: deque[CompletedGroup] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._taken = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def seen(self) -> int:
        """Groups ever put that were taken or still wait (one atomic count, for pacing)."""
        with self._cond:
            return self._taken + len(self._groups)

    def has_room(self) -> bool:
        """Whether a producer may start another group."""
        with self._cond:
            return len(self._groups) < self.capacity

    def put(self, group: CompletedGroup) -> None:
        """Append a completed group and wake a waiting consumer."""
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Make every waiting and later ``get`` raise ``error`` (the producer died)."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake waiters; later gets raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> CompletedGroup:
        """The oldest completed group; blocks until there is one.

        Raises:
            RuntimeError: the producer failed (chained to its error) or the buffer is closed.
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._groups:
                if self._error is not None:
                    raise RuntimeError(f"the rollout producer failed: {self._error!r}") from (
                        self._error
                    )
                if self._closed:
                    raise RuntimeError("the rollout buffer is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no completed group within {timeout} s")
                self._cond.wait(left)
            self._taken += 1
            return self._groups.popleft()

    def snapshot(self) -> list[CompletedGroup]:
        """The groups now buffered (for checkpoints), oldest first."""
        with self._cond:
            return list(self._groups)
