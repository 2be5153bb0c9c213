"""Least-recently-used: evict the expert whose last access is oldest."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from agent.policies.base import Key, Policy


class LRU(Policy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        return next(k for k in self._order if k not in pinned)
