"""Which resident experts prefetch brought in, and which of those were wasted.

A block brought in by prefetch is "unused" until a step uses it. When its layer routes without it,
the guess was wrong: it becomes "wasted", and a wasted block is the first to evict, so a wrong guess
displaces other wrong guesses rather than a block the policy chose to keep. Residency (the cache
core) keeps one ledger beside its policies.
"""
from __future__ import annotations

from collections.abc import Collection

from agent.policies.base import Key


class PrefetchLedger:
    def __init__(self) -> None:
        self._unused: dict[Key, None] = {}   # oldest first
        self._wasted: dict[Key, None] = {}

    def admitted(self, key: Key) -> None:
        """Prefetch brought `key` in."""
        self._unused[key] = None

    def routed(self, layer: int, experts: Collection[int]) -> None:
        """`layer` routed `experts`: its unused prefetches that are not among them were wasted."""
        for key in [k for k in self._unused if k[0] == layer and k[1] not in experts]:
            del self._unused[key]
            self._wasted[key] = None

    def clear(self, key: Key) -> bool:
        """`key` was used or left the cache: forget it; True if prefetch had brought it in."""
        marked = key in self._unused or key in self._wasted
        self._unused.pop(key, None)
        self._wasted.pop(key, None)
        return marked

    def wasted(self, resident: Collection[Key], keep: Collection[Key]) -> Key | None:
        """The oldest wasted prefetch among `resident` and not in `keep`, if any."""
        return next((k for k in self._wasted if k in resident and k not in keep), None)
