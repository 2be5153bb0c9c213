"""Belady's MIN: the offline oracle that evicts the resident expert whose next use is furthest.

It needs the future, so it runs only where the whole access sequence is known (the simulator).
One BeladyOracle serves every partition: partitions hold disjoint keys, and demand accesses reach
the oracle in replay order, so a single cursor indexes the precomputed next-use array.
Prefetch insertions are not modelled (every hit/insert must be the next demand access).
"""
from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

import numpy as np

from agent.policies.base import Key, Policy


class BeladyOracle:
    """The future of one access sequence: next_use[i] is the position of the next access to the same
    key after position i, or len(sequence) if it never recurs."""

    def __init__(self, accesses: np.ndarray | Sequence[Key]) -> None:
        a = np.asarray(accesses, dtype=np.int64).reshape(-1, 2)  # [N, 2] (layer, expert)
        width = int(a[:, 1].max()) + 1 if len(a) else 1
        codes = a[:, 0] * width + a[:, 1]
        order = np.argsort(codes, kind="stable")  # positions grouped by key, ascending within a key
        nxt = np.full(len(a), len(a), dtype=np.int64)
        same = codes[order[1:]] == codes[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        self.next_use = nxt
        self._layers, self._experts = a[:, 0].tolist(), a[:, 1].tolist()
        self._next = nxt.tolist()
        self._cursor = 0
        self._n = len(a)

    def __len__(self) -> int:
        return self._n

    def advance(self, key: Key) -> int:
        """Consume the current access (which must be `key`) and return the position of its next use."""
        i = self._cursor
        if i >= self._n or self._layers[i] != key[0] or self._experts[i] != key[1]:
            expected = (self._layers[i], self._experts[i]) if i < self._n else "the end of the sequence"
            raise ValueError(f"access {key} at position {i} does not follow the oracle's sequence "
                             f"(expected {expected}); Belady must replay exactly the trace it was built from")
        self._cursor = i + 1
        return self._next[i]


class Belady(Policy):
    name = "belady"

    def __init__(self, oracle: BeladyOracle) -> None:
        self._oracle = oracle
        self._next: dict[Key, int] = {}          # resident key -> position of its next use
        self._heap: list[tuple[int, Key]] = []   # (-next use, key); entries not in _next are stale

    def hit(self, key: Key) -> None:
        self._touch(key)

    def insert(self, key: Key) -> None:
        self._touch(key)

    def remove(self, key: Key) -> None:
        self._next.pop(key, None)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        skipped = []
        while True:
            entry = heapq.heappop(self._heap)
            if self._next.get(entry[1]) != -entry[0]:
                continue  # stale: the key was used again or left the cache
            skipped.append(entry)
            if entry[1] not in pinned:
                break
        for e in skipped:  # the victim's entry too: it stays valid until remove()
            heapq.heappush(self._heap, e)
        return entry[1]

    def _touch(self, key: Key) -> None:
        nxt = self._oracle.advance(key)
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))
        if len(self._heap) > 4 * len(self._next) + 64:  # drop stale entries so the heap stays O(resident)
            self._heap = [(-n, k) for k, n in self._next.items()]
            heapq.heapify(self._heap)
