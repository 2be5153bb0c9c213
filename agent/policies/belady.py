"""Belady's MIN: the offline oracle that evicts the resident expert whose next use is furthest.

It needs the future, so it runs only where the whole access sequence is known (the simulator).
One BeladyOracle serves every partition: partitions hold disjoint keys, and demand accesses reach
the oracle in replay order, so one count of the accesses so far tells which step is being replayed.
Within a step the accesses may come in any order (a step larger than its partition is taken
resident experts first: Residency.take): each is the key's first access not yet consumed, which
must lie in that step. Prefetch insertions are not modelled (every hit/insert must be a demand access).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from copy import copy

import numpy as np

from agent.policies.base import Key, Policy
from agent.policies.lfu import KeyedHeap


class BeladyOracle:
    """The future of one access sequence: next_use[i] is the position of the next access to the same
    key after position i, or len(sequence) if it never recurs. `offsets` are the bounds of its steps
    (a trace's rows; the accesses of one step are distinct keys); without them every access is a step."""

    def __init__(self, accesses: np.ndarray | Sequence[Key], offsets: np.ndarray | None = None) -> None:
        a = np.asarray(accesses, dtype=np.int64).reshape(-1, 2)  # [N, 2] (layer, expert)
        self._width = int(a[:, 1].max()) + 1 if len(a) else 1
        codes = a[:, 0] * self._width + a[:, 1]
        order = np.argsort(codes, kind="stable")  # positions grouped by key, ascending within a key
        nxt = np.full(len(a), len(a), dtype=np.int64)
        same = codes[order[1:]] == codes[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        self.next_use = nxt
        keys, first, count = np.unique(codes[order], return_index=True, return_counts=True)
        self._where = dict(zip(keys.tolist(), zip(first.tolist(), count.tolist())))  # code -> (index in order, uses)
        step = np.arange(len(a)) if offsets is None else \
            np.repeat(np.arange(len(offsets) - 1), np.diff(np.asarray(offsets, dtype=np.int64)))
        # memoryviews: indexed as fast as lists, at 8 bytes an access where a list of ints took 36 each, three
        # times over (a 32 MB trace of 6.5M accesses made simulate's RSS 1.4 GB)
        self._order, self._next, self._step = (memoryview(np.ascontiguousarray(x, dtype=np.int64))
                                               for x in (order, nxt, step))
        self._taken: dict[int, int] = {}  # key code -> its accesses consumed
        self._cursor = 0
        self._n = len(a)

    def __len__(self) -> int:
        return self._n

    @property
    def consumed(self) -> int:
        """Accesses consumed so far: the position of the next one."""
        return self._cursor

    def fresh(self) -> BeladyOracle:
        """The same future with nothing consumed: a second reader of one sequence, at no cost."""
        other = copy(self)
        other._taken, other._cursor = {}, 0
        return other

    def advance(self, key: Key) -> int:
        """Consume `key`'s access in the step being replayed and return the position of its next use."""
        code = key[0] * self._width + key[1] if 0 <= key[1] < self._width else -1
        first, uses = self._where.get(code, (0, 0))
        taken = self._taken.get(code, 0)
        p = self._order[first + taken] if taken < uses else self._n
        if self._cursor >= self._n or p >= self._n or self._step[p] != self._step[self._cursor]:
            where = f"step {self._step[self._cursor]}" if self._cursor < self._n else "the end of the sequence"
            raise ValueError(f"access {key} at position {self._cursor} does not follow the oracle's sequence "
                             f"(not an access of {where} left to take); Belady must replay exactly the trace "
                             f"it was built from")
        self._taken[code] = taken + 1
        self._cursor += 1
        return self._next[p]


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
