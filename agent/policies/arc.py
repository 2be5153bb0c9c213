"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 are their ghosts
(evicted keys, no data). A miss that hits a ghost moves the target size p of T1: a B1 ghost says
"T1 was too small", a B2 ghost the opposite. Ghost lists are bounded as in the paper:
|T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c, with c the partition's capacity.

The cache calls victim() before insert() of the incoming key, while ARC's REPLACE needs that key
(to adapt p first, and for its B2 tie rule). The incoming key is the first expert of the current
route() that is not resident yet, because the cache accesses a step's experts in routed order;
for an admission outside the routed set (a prefetch) it is unknown and p adapts at insert().
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from agent.policies.base import Key, Policy


class ARC(Policy):
    name = "arc"

    def __init__(self) -> None:
        self.p = 0.0  # target size of T1
        self._c = 0   # capacity c, learned from the resident count when the cache is full
        self._t1: OrderedDict[Key, None] = OrderedDict()  # LRU first
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._routed: list[Key] = []
        self._adapted: Key | None = None  # incoming key whose ghost hit already moved p
        self._no_ghost: Key | None = None  # victim dropped without a ghost (ARC case IV.A, |T1| = c)

    def route(self, layer: int, experts: Collection[int]) -> None:
        self._routed = [(layer, e) for e in experts]

    def hit(self, key: Key) -> None:
        (self._t1 if key in self._t1 else self._t2).pop(key, None)
        self._t2[key] = None

    def insert(self, key: Key) -> None:
        if key in self._b1 or key in self._b2:
            if self._adapted != key:
                self._adapt(key)
            (self._b1 if key in self._b1 else self._b2).pop(key)
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._adapted = None
        self._bound_ghosts()

    def remove(self, key: Key) -> None:
        for live, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if key in live:
                del live[key]
                if key != self._no_ghost:
                    ghost[key] = None
        self._no_ghost = None
        self._bound_ghosts()

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        self._c = len(resident)  # the cache is full when it asks (or shrinking towards a new capacity)
        x = next((k for k in self._routed if k not in resident), None)
        t1 = len(self._t1)
        if x in self._b1 or x in self._b2:
            self._adapt(x)
            self._adapted = x
        elif t1 + len(self._b1) >= self._c and t1 >= self._c:
            self._no_ghost = victim = self._oldest(self._t1, pinned) or self._oldest(self._t2, pinned)
            return victim
        elif t1 + len(self._b1) >= self._c and self._b1:
            self._b1.popitem(last=False)  # case IV.A: make room in L1's ghost
        elif len(self._t2) + len(self._b2) + t1 + len(self._b1) >= 2 * self._c and self._b2:
            self._b2.popitem(last=False)  # case IV.B
        prefer_t1 = t1 >= 1 and (t1 > self.p or (x in self._b2 and t1 == self.p))
        first, second = (self._t1, self._t2) if prefer_t1 else (self._t2, self._t1)
        return self._oldest(first, pinned) or self._oldest(second, pinned)

    def _adapt(self, key: Key) -> None:
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self.p = min(float(self._c), self.p + max(b2 / b1, 1.0))
        else:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))

    def _bound_ghosts(self) -> None:
        c = max(self._c, len(self._t1) + len(self._t2))
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    @staticmethod
    def _oldest(keys: OrderedDict[Key, None], pinned: Collection[Key]) -> Key | None:
        return next((k for k in keys if k not in pinned), None)
