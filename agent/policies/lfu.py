"""Least-frequently-used, over the whole history or a sliding window; ties go to the least recent.

"lfu" counts every access the partition ever saw (evicted experts keep their count: "perfect"
LFU, so an expert that comes back is not treated as new). "lfu-window" counts only the last
`window` accesses of each layer, so yesterday's favourites age out as the input drifts. The window
is per layer (in global scope too) so that it spans the same number of tokens in either scope.
"""
from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Collection
from typing import Any

from agent.policies.base import Key, Policy

DEFAULT_WINDOW = 512  # accesses of one layer (64 OLMoE tokens); best of 64..2048 on the train split


class KeyedHeap:
    """Resident keys by priority (smallest first), updated lazily: set() pushes a fresh entry and
    pops skip entries that no longer match, so every update is O(log n) with no search."""

    def __init__(self) -> None:
        self._prio: dict[Key, Any] = {}  # priorities: anything orderable
        self._heap: list[tuple] = []

    def set(self, key: Key, prio: Any) -> None:
        self._prio[key] = prio
        heapq.heappush(self._heap, (prio, key))
        if len(self._heap) > 4 * len(self._prio) + 64:  # drop stale entries so memory stays O(keys)
            self._heap = [(p, k) for k, p in self._prio.items()]
            heapq.heapify(self._heap)

    def discard(self, key: Key) -> None:
        self._prio.pop(key, None)

    def __contains__(self, key: Key) -> bool:
        return key in self._prio

    def smallest(self, excluded: Collection[Key]) -> Key:
        """The key with the smallest priority that is not in `excluded` (left in place)."""
        skipped = []
        while True:
            entry = heapq.heappop(self._heap)
            if self._prio.get(entry[1]) != entry[0]:
                continue  # stale entry
            skipped.append(entry)
            if entry[1] not in excluded:
                break
        for e in skipped:
            heapq.heappush(self._heap, e)
        return entry[1]


class LFU(Policy):
    name = "lfu"

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"lfu window must be a positive number of accesses, got {window}")
        self._window = window
        self._recent: dict[int, deque[Key]] = {}  # per layer: its last `window` accesses (windowed only)
        self._count: Counter[Key] = Counter()
        self._last: dict[Key, int] = {}
        self._clock = 0
        self._heap = KeyedHeap()  # resident keys by (count, last access)

    def hit(self, key: Key) -> None:
        self._touch(key)

    def insert(self, key: Key) -> None:
        self._touch(key)

    def remove(self, key: Key) -> None:
        self._heap.discard(key)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        return self._heap.smallest(pinned)

    def _touch(self, key: Key) -> None:
        self._clock += 1
        self._count[key] += 1
        self._last[key] = self._clock
        self._heap.set(key, (self._count[key], self._clock))
        if self._window is not None:
            recent = self._recent.setdefault(key[0], deque())
            recent.append(key)
            if len(recent) > self._window:
                self._expire(recent.popleft())

    def _expire(self, key: Key) -> None:
        self._count[key] -= 1
        if key in self._heap:
            self._heap.set(key, (self._count[key], self._last[key]))


class WindowedLFU(LFU):
    name = "lfu-window"

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        super().__init__(window)
