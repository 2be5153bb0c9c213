"""The replacement-policy contract shared by the runtime cache and the simulator.

A policy never changes residency itself: the cache (agent.residency.Residency) owns which experts
are resident and calls these hooks. One policy instance serves one cache partition (one layer, or
the whole model in global scope), so per-entry state stays small and victim search stays local.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import ClassVar

from agent.knob import Knob

Key = tuple[int, int]  # (layer, expert)

REGISTRY: dict[str, type["Policy"]] = {}


class Policy:
    name: ClassVar[str] = ""
    # Live settings the constructor takes by the same names; the agent offers each as a knob.
    knobs: ClassVar[tuple[Knob, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        """A class registers under the name it declares itself: a subclass that only inherits a name
        (a test double, a variant) must not take its parent's place in the registry."""
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            REGISTRY[cls.name] = cls

    def session(self) -> None:
        """A new session (a prompt or request) begins."""

    def prepare(self, layer: int, sample: Mapping[str, float]) -> None:
        """A step of `layer` is about to be routed, after `sample` (empty: none) goes to system(): do the
        slow work they will need now, outside the cache's lock (which a resize may be waiting for),
        without changing any decision."""

    def system(self, sample: Mapping[str, float]) -> None:
        """A monitoring sample arrived, e.g. {"read_latency_s": ..., "mem_pressure": ...}."""

    def route(self, layer: int, experts: Collection[int]) -> None:
        """The router chose `experts` at `layer` for the current token(s); called before their accesses."""

    def hit(self, key: Key) -> None:
        """`key` was requested and found resident."""

    def insert(self, key: Key) -> None:
        """`key` was just brought in (on a miss or by prefetch)."""

    def remove(self, key: Key) -> None:
        """`key` left the cache (evicted or dropped by a shrink)."""

    def victim(self, resident: Collection[Key], pinned: Collection[Key]) -> Key:
        """Choose the key to evict among `resident` keys that are not `pinned`."""
        raise NotImplementedError
