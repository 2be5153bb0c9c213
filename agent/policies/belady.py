"""Belady's MIN: the offline oracle that evicts the resident expert whose next use is furthest.

It needs the future, so it runs only where the whole access sequence is known (the simulator).
One BeladyOracle serves every partition: partitions hold disjoint keys, and demand accesses reach
the oracle in replay order, so a single cursor indexes the precomputed next-use array.
Prefetch insertions are not modelled (every hit/insert must be the next demand access).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from agent.policies.base import Key, Policy
from agent.policies.lfu import KeyedHeap


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
        self._heap = KeyedHeap()  # resident keys by -(position of next use): furthest first

    def hit(self, key: Key) -> None:
        self._heap.set(key, -self._oracle.advance(key))

    def insert(self, key: Key) -> None:
        self._heap.set(key, -self._oracle.advance(key))

    def remove(self, key: Key) -> None:
        self._heap.discard(key)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        return self._heap.smallest(pinned)
