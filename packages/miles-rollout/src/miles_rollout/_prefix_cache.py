"""The prefix cache: a radix tree over token ids whose nodes own slots of a KV token pool.

Design: a running request owns one row of the runner's KV cache (the decode hot path is
unchanged); the prefix cache is a second, token-granular pool (``[slots, kv heads, head_dim]``
per layer, in the runner) indexed by this tree, as SGLang's radix cache indexes its token pool.
When a request finishes (or is aborted or retracted) its KV is copied from its row into slots
and its tokens are inserted; a new request whose tokens share a prefix with the tree gets that
prefix's KV copied into its row and only the rest is prefilled. Copies cost memory bandwidth
(a few KB per token) where a prefill costs compute.

The tree is pure bookkeeping: which token sequence lives in which slots, LRU order, locks and
session reservations (``reserve``). Copying KV is the caller's (``write`` in :meth:`insert`).
Everything runs on the scheduler thread.
"""

from __future__ import annotations

import heapq
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
    last_used: int = 0  # logical clock of the last match or insert through this node


@dataclass(slots=True)
class CacheStats:
    """Counters of one prefix cache (cumulative unless said otherwise).

    Attributes:
        capacity_tokens: the pool's size in tokens.
        cached_tokens: tokens in the tree now.
        inserted_tokens: tokens written into the pool.
        evicted_tokens: tokens dropped to make room.
        flushes: how many times the whole cache was dropped (flush or weight update).
    """

    capacity_tokens: int
    cached_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    flushes: int = 0


class RadixCache:
    """Token prefixes -> pool slots, with LRU eviction of unlocked leaves.

    Args:
        capacity: the number of pool slots (tokens) the tree may use.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 token, got {capacity}")
        self.capacity = capacity
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
        self.stats.cached_tokens = 0

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
        can_evict: Callable[[_Node], bool] | None = None,
    ) -> int:
        """Cache ``tokens``; return how many new tokens were written.

        The part already in the tree is kept (and touched); for the rest, slots are taken
        (evicting least recently used unlocked leaves if needed) and ``write(start, slots)``
        must copy the KV of positions ``start .. start + len(slots) - 1`` into them. When the
        pool cannot make room for all of it, only the first tokens that fit are cached.

        Args:
            tokens: the token sequence whose KV the caller holds.
            write: copies KV into the given slots.
            can_evict: an extra condition on which leaves may be evicted (reservations).
        """
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
                self.evict(rest - self.free_slots, can_evict=can_evict)
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

    def evict(self, n: int, *, can_evict: Callable[[_Node], bool] | None = None) -> int:
        """Free at least ``n`` slots from least recently used unlocked leaves (fewer if the
        rest is locked); return how many were freed."""
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._evictable_leaves(can_evict)]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._free.extend(leaf.slots.tolist())
            freed += len(leaf.tokens)
            if (
                parent is not self._root
                and not parent.children
                and self._evictable(parent, can_evict)
            ):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.stats.cached_tokens -= freed
        self.stats.evicted_tokens += freed
        return freed

    def _evictable(self, node: _Node, can_evict: Callable[[_Node], bool] | None) -> bool:
        return node.lock == 0 and (can_evict is None or can_evict(node))

    def _evictable_leaves(self, can_evict: Callable[[_Node], bool] | None) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root and self._evictable(node, can_evict):
                out.append(node)
        return out

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
