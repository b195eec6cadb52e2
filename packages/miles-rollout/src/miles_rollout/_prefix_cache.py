"""The prefix cache: a radix tree over token ids whose nodes own slots of a KV token pool.

Design: a running request owns one row of the runner's KV cache (the decode hot path is
unchanged); the prefix cache is a second, token-granular pool (``[slots, kv heads, head_dim]``
per layer, in the runner) indexed by this tree, as SGLang's radix cache indexes its token pool.
When a request finishes (or is aborted or retracted) its KV is copied from its row into slots
and its tokens are inserted; a new request whose tokens share a prefix with the tree gets that
prefix's KV copied into its row and only the rest is prefilled. Copies cost memory bandwidth
(a few KB per token) where a prefill costs compute.

The tree is pure bookkeeping: which token sequence lives in which slots, LRU order, locks and
session reservations. Copying KV is the caller's (``write`` in :meth:`insert`). Everything runs
on the scheduler thread.

Session reservations (multi-turn sessions keyed by their routing key). After a session's turn
the path of its tokens is reserved for it, so its next turn finds the whole history cached.
The policy, in order:

1. Eviction takes unreserved, unlocked leaves first, least recently used first.
2. A session gets a reservation only while the reserved tokens plus the room kept for every
   reserved session's next turn (its growth last turn) stay within ``reserve_fraction`` of the
   pool: admission control for sessions. A session that does not fit is cached like any other
   request (LRU) and asks again after its next turn; sessions already in keep their room.
3. A request without a reservation never evicts reserved entries: it is cached only in what
   unreserved room there is (or not at all).
4. A reserved session that outgrows the free and unreserved room takes it from the other
   reservations, the one idle longest first (its owner then re-prefills what it loses).
5. A reservation idle for ``session_ttl_s`` (no new turn) expires: the session is over or
   stuck in a tool; its entries become ordinary LRU entries.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["CacheStats", "RadixCache"]


@dataclass(eq=False, slots=True)
class _Node:
    tokens: list[int]  # the edge label: tokens after the parent's
    slots: torch.Tensor  # int64 [len(tokens)]: where their KV lives in the pool
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    lock: int = 0  # > 0: in use, never evicted
    reserve: int = 0  # sessions whose reserved path goes through this node
    last_used: int = 0  # logical clock of the last match or insert through this node


@dataclass(eq=False, slots=True)
class _Reservation:
    node: _Node  # where the session's reserved path ends
    tokens: int  # the path's length
    growth: int  # room kept for the session's next turn (what its last turn added)
    last_active: float  # when a turn of it last started or ended


@dataclass(slots=True)
class CacheStats:
    """Counters of one prefix cache (cumulative unless said otherwise).

    Attributes:
        capacity_tokens: the pool's size in tokens.
        cached_tokens: tokens in the tree now.
        inserted_tokens: tokens written into the pool.
        evicted_tokens: tokens dropped to make room.
        flushes: how many times the whole cache was dropped (flush or weight update).
        reserved_tokens: cached tokens on some session's reserved path now.
        sessions: sessions holding a reservation now.
        reservations_refused: sessions refused a reservation (admission control).
        reservations_dropped: reservations taken by a growing session (policy rule 4).
        reservations_expired: reservations idle past the session TTL.
    """

    capacity_tokens: int
    cached_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    flushes: int = 0
    reserved_tokens: int = 0
    sessions: int = 0
    reservations_refused: int = 0
    reservations_dropped: int = 0
    reservations_expired: int = 0


class RadixCache:
    """Token prefixes -> pool slots, with LRU eviction and session reservations.

    Args:
        capacity: the number of pool slots (tokens) the tree may use.
        session_ttl_s: how long a session's reservation outlives its last turn.
        reserve_fraction: the share of the pool that reservations plus the room kept for
            their next turns may take (the rest stays for other requests).
        now: the clock (for tests).
    """

    def __init__(
        self,
        capacity: int,
        *,
        session_ttl_s: float = 300.0,
        reserve_fraction: float = 0.9,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 token, got {capacity}")
        if not 0.0 < reserve_fraction <= 1.0:
            raise ValueError(f"reserve_fraction must be in (0, 1], got {reserve_fraction}")
        self.capacity = capacity
        self.session_ttl_s = session_ttl_s
        self.reserve_fraction = reserve_fraction
        self._now = now
        self.stats = CacheStats(capacity_tokens=capacity)
        self._clock = 0
        self.reset()

    # ---- slots -------------------------------------------------------------------------------

    @property
    def high_water(self) -> int:
        """One past the highest slot ever handed out (the pool must be at least this big)."""
        return self._next_fresh

    @property
    def free_slots(self) -> int:
        return len(self._free) + self.capacity - self._next_fresh

    def _take(self, n: int) -> torch.Tensor:
        assert n <= self.free_slots
        reuse = min(n, len(self._free))
        out = self._free[len(self._free) - reuse :]
        del self._free[len(self._free) - reuse :]
        fresh = n - reuse
        out.extend(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        return torch.tensor(out, dtype=torch.int64)

    # ---- the tree ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every entry (the pool's contents become garbage)."""
        self._root = _Node(tokens=[], slots=torch.empty(0, dtype=torch.int64), parent=None)
        self._root.lock = 1  # never evicted
        self._free: list[int] = []
        self._next_fresh = 0
        self._reservations: dict[str, _Reservation] = {}
        self.stats.cached_tokens = 0
        self.stats.reserved_tokens = 0
        self.stats.sessions = 0

    def flush(self) -> None:
        """:meth:`reset`, counted as a flush."""
        self.reset()
        self.stats.flushes += 1

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """The longest cached prefix of ``tokens``: ``(length, slots [length])``.

        Marks the matched path as recently used.
        """
        now = self._tick()
        node, pos, parts = self._root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.tokens, tokens, pos)
            child.last_used = now
            parts.append(child.slots[:n])
            pos += n
            if n < len(child.tokens):
                break
            node = child
        if not parts:
            return 0, torch.empty(0, dtype=torch.int64)
        return pos, torch.cat(parts)

    def insert(
        self,
        tokens: Sequence[int],
        write: Callable[[int, torch.Tensor], None],
        *,
        session: str | None = None,
    ) -> int:
        """Cache ``tokens``; return how many new tokens were written.

        The part already in the tree is kept (and touched); for the rest, slots are taken
        (evicting as the module docstring's policy says) and ``write(start, slots)`` must copy
        the KV of positions ``start .. start + len(slots) - 1`` into them. When the pool
        cannot make room for all of it, only the first tokens that fit are cached.

        Args:
            tokens: the token sequence whose KV the caller holds.
            write: copies KV into the given slots.
            session: the session the tokens belong to; a session holding a reservation may
                take room from other reservations.
        """
        self._expire()
        now = self._tick()
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.tokens, tokens, pos)
            child.last_used = now
            if n < len(child.tokens):
                child = self._split(child, n)
            node, pos = child, pos + n
        rest = len(tokens) - pos
        if rest == 0:
            return 0
        self._lock(node)
        try:
            if self.free_slots < rest:
                self.evict(rest - self.free_slots)
            if self.free_slots < rest and session in self._reservations:
                self._take_from_reservations(session, rest)
            n = min(rest, self.free_slots)
            if n == 0:
                return 0
            slots = self._take(n)
        finally:
            self._unlock(node)
        write(pos, slots)
        leaf = _Node(tokens=list(tokens[pos : pos + n]), slots=slots, parent=node, last_used=now)
        node.children[leaf.tokens[0]] = leaf
        self.stats.cached_tokens += n
        self.stats.inserted_tokens += n
        return n

    def evict(self, n: int) -> int:
        """Free at least ``n`` slots from least recently used unlocked, unreserved leaves
        (fewer if the rest is locked or reserved); return how many were freed."""
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._free.extend(leaf.slots.tolist())
            freed += len(leaf.tokens)
            if parent is not self._root and not parent.children and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.stats.cached_tokens -= freed
        self.stats.evicted_tokens += freed
        return freed

    @staticmethod
    def _evictable(node: _Node) -> bool:
        return node.lock == 0 and node.reserve == 0

    def _evictable_leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root and self._evictable(node):
                out.append(node)
        return out

    # ---- session reservations ----------------------------------------------------------------

    def reserve(self, session: str, tokens: Sequence[int], growth: int) -> bool:
        """Reserve the cached path of ``tokens`` for ``session`` (after :meth:`insert`).

        A session that holds a reservation moves it to the new path; a new one is admitted
        only if reservations and the room kept for every reserved session's next turn stay
        within ``reserve_fraction`` of the pool. Returns whether the session holds one now.

        Args:
            session: the session key.
            tokens: the session's tokens so far (what was just inserted).
            growth: room to keep for its next turn (what this turn added).
        """
        self._expire()
        node = self._path_end(tokens)
        if node is self._root:
            return False
        old = self._reservations.pop(session, None)
        if old is not None:
            self._unreserve_path(old.node)
        else:
            fresh, walk = 0, node
            while walk is not self._root:
                fresh += len(walk.tokens) if walk.reserve == 0 else 0
                walk = walk.parent  # type: ignore[assignment]
            room = sum(r.growth for r in self._reservations.values())
            if self.stats.reserved_tokens + fresh + room + growth > (
                self.reserve_fraction * self.capacity
            ):
                self.stats.reservations_refused += 1
                return False
        depth, walk = 0, node
        while walk is not self._root:
            depth += len(walk.tokens)
            walk = walk.parent  # type: ignore[assignment]
        self._reserve_path(node)
        self._reservations[session] = _Reservation(
            node=node, tokens=depth, growth=max(1, growth), last_active=self._now()
        )
        self.stats.sessions = len(self._reservations)
        return True

    def touch(self, session: str) -> None:
        """A turn of ``session`` started: its reservation is active again."""
        res = self._reservations.get(session)
        if res is not None:
            res.last_active = self._now()

    def release(self, session: str) -> None:
        """Drop ``session``'s reservation (its entries stay, as ordinary LRU entries)."""
        res = self._reservations.pop(session, None)
        if res is not None:
            self._unreserve_path(res.node)
            self.stats.sessions = len(self._reservations)

    def reserved_sessions(self) -> list[str]:
        """The sessions holding a reservation, idle longest first."""
        return sorted(self._reservations, key=lambda s: self._reservations[s].last_active)

    def _expire(self) -> None:
        if not self._reservations:
            return
        limit = self._now() - self.session_ttl_s
        for session in [s for s, r in self._reservations.items() if r.last_active < limit]:
            self.release(session)
            self.stats.reservations_expired += 1

    def _take_from_reservations(self, session: str, need: int) -> None:
        """Policy rule 4: drop other sessions' reservations, idle longest first."""
        for other in self.reserved_sessions():
            if self.free_slots >= need:
                return
            if other == session:
                continue
            self.release(other)
            self.stats.reservations_dropped += 1
            self.evict(need - self.free_slots)

    def _path_end(self, tokens: Sequence[int]) -> _Node:
        """The node where the cached prefix of ``tokens`` ends (split there if mid-edge)."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                return self._split(child, n) if n else node
            node, pos = child, pos + n
        return node

    def _reserve_path(self, node: _Node) -> None:
        while node is not self._root:
            if node.reserve == 0:
                self.stats.reserved_tokens += len(node.tokens)
            node.reserve += 1
            node = node.parent  # type: ignore[assignment]

    def _unreserve_path(self, node: _Node) -> None:
        while node is not self._root:
            node.reserve -= 1
            if node.reserve == 0:
                self.stats.reserved_tokens -= len(node.tokens)
            node = node.parent  # type: ignore[assignment]

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        assert 0 < n < len(child.tokens)
        upper = _Node(
            tokens=child.tokens[:n],
            slots=child.slots[:n],
            parent=parent,
            lock=child.lock,
            reserve=child.reserve,
            last_used=child.last_used,
        )
        parent.children[upper.tokens[0]] = upper
        child.tokens, child.slots, child.parent = child.tokens[n:], child.slots[n:], upper
        upper.children[child.tokens[0]] = child
        return upper

    def _lock(self, node: _Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def _unlock(self, node: _Node) -> None:
        while node is not None:
            node.lock -= 1
            node = node.parent  # type: ignore[assignment]


def _common(edge: list[int], tokens: Sequence[int], pos: int) -> int:
    n = min(len(edge), len(tokens) - pos)
    i = 0
    while i < n and edge[i] == tokens[pos + i]:
        i += 1
    return i
