"""Least-Stale: experts touched in the current token's forward pass are fresh, all others stale;
evict stale experts first, oldest first, and fresh ones only when no stale expert can go.

A forward pass starts when route() comes back to a layer at or below the previous one (the layer
index wrapped around: a new token or batch step) and at every session start; in per-layer scope
every route() of the partition is a new pass. "Oldest" is the load order: had it been the last-use
order, stale-first would be LRU exactly, since every fresh expert was used after every stale one.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from agent.policies.base import Key, Policy


class LeastStale(Policy):
    name = "least-stale"

    def __init__(self) -> None:
        self._loaded: OrderedDict[Key, None] = OrderedDict()  # resident keys, oldest load first
        self._fresh: set[Key] = set()
        self._layer = -1

    def session(self) -> None:
        self._fresh, self._layer = set(), -1

    def route(self, layer: int, experts: Collection[int]) -> None:
        if layer <= self._layer:
            self._fresh = set()
        self._layer = layer

    def hit(self, key: Key) -> None:
        self._fresh.add(key)

    def insert(self, key: Key) -> None:
        self._loaded[key] = None
        self._fresh.add(key)

    def remove(self, key: Key) -> None:
        self._loaded.pop(key, None)
        self._fresh.discard(key)

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        fresh = self._fresh
        stale = next((k for k in self._loaded if k not in fresh and k not in pinned), None)
        return stale if stale is not None else next(k for k in self._loaded if k not in pinned)
