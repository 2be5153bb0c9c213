"""Which experts are resident: the cache with the I/O taken out.

The runtime ExpertCache (agent.experts.cache) adds slots and SSD reads on top of this class; the
simulator (agent.simulator) drives it directly from a routing trace. Both therefore run the very
same policy objects and eviction decisions, and the same adaptive prefetch (agent.prefetch_gate:
every lookahead guess is scored here, its reads let through only while they pay). Capacity is
counted in slots (one expert block each: all routed experts of a model have the same shape). In
"layer" scope every layer owns an equal share of the slots and its own policy instance; in "global"
scope all layers share one.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from agent.policies.base import Key, Policy
from agent.prefetch_gate import PrefetchGate
from agent.prefetch_ledger import PrefetchLedger

SCOPES = ("layer", "global")


def step_window(size: int, at: int, residents: int, room: int, ahead: int) -> tuple[int, int]:
    """The part [start, stop) of a layer's step to pin while its expert at `at` is in use: the step's
    `size` experts in the order they are taken (its `residents` resident ones first), a partition of
    `room` slots. A step that fits is pinned whole; a larger one (a batch's union) `ahead` experts from
    `at` on, and its residents until their use, so none is evicted before it is used and every miss
    finds an expert to evict (at most `ahead` - 1 stay pinned)."""
    span = room if size <= room else min(room, ahead)
    start = max(0, min(at, size - span))
    return start, max(start + span, residents)


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0  # demand hits on a block that prefetch brought in
    rereads: int = 0        # misses on a block the cache held and evicted (not a first read)


@dataclass
class _Partition:
    capacity: int
    policy: Policy
    resident: set[Key] = field(default_factory=set)
    # Keys evicted and not read back since: a miss on one is a re-read, not a first read. Every one
    # is remembered (at most the model's blocks): a ghost list of the last `capacity` evictions saw
    # few of a small cap's re-reads, whose blocks went several capacities ago (7% of the misses at
    # the small demo's smallest cap, hit rate 0.30, against 30% at its default cap, hit rate 0.58).
    evicted: set[Key] = field(default_factory=set)


class Residency:
    def __init__(self, capacity: int, n_layers: int, policy_factory: Callable[[], Policy],
                 scope: str = "layer", min_per_layer: int = 1, prefetch: str = "auto") -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.scope, self.n_layers, self.min_per_layer = scope, n_layers, min_per_layer
        self.stats = [LayerStats() for _ in range(n_layers)]
        self._pinned: set[Key] = set()
        self._ledger = PrefetchLedger()
        self.gate = PrefetchGate(prefetch)
        self._guessed: dict[int, set[int]] = {}   # layer -> the reads its pending guess made (or would have)
        self._evicted_by: dict[Key, bool] = {}    # the policy's blocks evicted, not back since -> by a prefetch?
        self._parts = [_Partition(c, policy_factory()) for c in self._split(capacity)]

    # -- capacity -------------------------------------------------------------------------------
    @staticmethod
    def min_capacity(n_layers: int, min_per_layer: int, scope: str) -> int:
        """Fewest slots that hold one layer's working set: only the layer being computed is pinned,
        so global scope needs one layer's share, layer scope that share in every layer."""
        return min_per_layer * (n_layers if scope == "layer" else 1)

    def _split(self, capacity: int) -> list[int]:
        if capacity < self.min_capacity(self.n_layers, self.min_per_layer, self.scope):
            raise ValueError(f"capacity of {capacity} slots is below the working set of one layer "
                             f"({self.min_per_layer} experts per layer, scope {self.scope})")
        if self.scope == "layer":
            return [capacity // self.n_layers] * self.n_layers
        return [capacity]

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self._parts)

    def capacity_for(self, capacity: int) -> int:
        """The capacity resize(capacity) gives: in layer scope a multiple of the layer count."""
        return sum(self._split(capacity))

    def resize(self, capacity: int) -> list[Key]:
        """Set a new capacity; returns the keys evicted (by the policy) to fit. Pinned keys (the running
        step's) stay past it: the next resize after they are unpinned evicts them."""
        evicted = []
        for part, cap in zip(self._parts, self._split(capacity)):
            part.capacity = cap
            while len(part.resident) > cap and part.resident - self._pinned:
                evicted.append(self._evict(part))
        return evicted

    # -- access -----------------------------------------------------------------------------------
    def _part(self, key: Key) -> _Partition:
        return self._parts[key[0] if self.scope == "layer" else 0]

    def __contains__(self, key: Key) -> bool:
        return key in self._part(key).resident

    def __len__(self) -> int:
        return sum(len(p.resident) for p in self._parts)

    def resident(self) -> list[Key]:
        return [k for p in self._parts for k in p.resident]

    def session(self) -> None:
        for part in self._parts:
            part.policy.session()

    def prepare(self, layer: int, sample: Mapping[str, float]) -> None:
        """Policy.prepare for a route() of `layer`: a sample goes to every partition, a step to one."""
        for part in self._parts if sample else [self._parts[layer if self.scope == "layer" else 0]]:
            part.policy.prepare(layer, sample)

    def system(self, sample: Mapping[str, float]) -> None:
        for part in self._parts:
            part.policy.system(sample)

    def route(self, layer: int, experts: Collection[int]) -> None:
        """Start a layer's step: its chosen experts are pinned until the next route()."""
        self._pinned = {(layer, e) for e in experts}
        self._ledger.routed(layer, experts)
        if (reads := self._guessed.pop(layer, None)) is not None:
            right = len(reads.intersection(experts))
            self.gate.score(right, len(reads) - right)
        self._parts[layer if self.scope == "layer" else 0].policy.route(layer, experts)

    def pin(self, keys: Collection[Key]) -> None:
        """Narrow the pinned set to `keys`: a step larger than a partition is used in windows, and
        only the window still to be used must stay (the policy already saw the whole step in route())."""
        self._pinned = set(keys)

    def is_pinned(self, key: Key) -> bool:
        return key in self._pinned

    def take(self, layer: int, experts: list[int], ahead: int) -> None:
        """A layer's whole step the way the runtime cache takes it (agent.experts.cache, with no reads
        to wait for): route, then every expert once. A step larger than its partition goes resident
        experts first, in the windows step_window() pins as the model moves through it."""
        self.route(layer, experts)
        room = self._parts[layer if self.scope == "layer" else 0].capacity
        if len(experts) <= room:
            for e in experts:
                self.access((layer, e))
            return
        order = sorted(experts, key=lambda e: (layer, e) not in self)
        residents, taken = sum((layer, e) in self for e in experts), 0
        for at in range(len(order)):
            start, stop = step_window(len(order), at, residents, room, ahead)
            if stop > taken:
                self.pin([(layer, e) for e in order[start:stop]])
                for e in order[taken:stop]:
                    self.access((layer, e))
                taken = stop

    def access(self, key: Key) -> tuple[bool, Key | None]:
        """Demand access. Returns (hit, evicted key or None); on a miss the key becomes resident."""
        part, stats = self._part(key), self.stats[key[0]]
        if key in part.resident:
            stats.hits += 1
            if self._ledger.clear(key):
                stats.prefetch_hits += 1
            part.policy.hit(key)
            return True, None
        stats.misses += 1
        if key in part.evicted:
            stats.rereads += 1
        if key in self._evicted_by:
            self.gate.reread(self._evicted_by[key])
        return False, self._admit(part, key, cause="demand")

    def prefetch(self, key: Key, protect: Collection[Key] = ()) -> tuple[bool, Key | None]:
        """Speculative admission. Returns (admitted, evicted key); never evicts a pinned expert nor
        one in `protect` (e.g. resident experts the same guess names: evicting them trades a hit for a read)."""
        part = self._part(key)
        if key in part.resident:
            return False, None
        keep = self._pinned.union(protect)
        if len(part.resident) >= part.capacity and not (part.resident - keep):
            return False, None
        self.stats[key[0]].prefetches += 1
        self._ledger.admitted(key)
        return True, self._admit(part, key, keep, "prefetch")

    def guess(self, layer: int, experts: Sequence[int]) -> list[tuple[Key, Key | None]]:
        """Score a lookahead guess at `layer`'s next step, most likely first, and admit its reads if the
        gate lets them through; returns each admitted key with the key it evicted (or None). Its reads
        are the experts not resident, while room lasts. No expert the guess names is the victim:
        evicting one the step will hit only trades that hit for a read. A batched step's guess names
        most of the layer, so only the few residents it does not name make room, and they go to the
        likeliest experts (in ascending ids, 19-31% of them went unused on OLMoE's traces at 8 requests
        a step; ranked, 4-12%)."""
        part = self._parts[layer if self.scope == "layer" else 0]
        protect = {(layer, e) for e in experts}
        room = part.capacity - len(part.resident & (self._pinned | protect))  # what prefetch() would admit
        reads = [(layer, e) for e in experts if (layer, e) not in part.resident][:max(0, room)]
        self._guessed[layer] = {e for _, e in reads}
        if not self.gate.issues:
            return []
        admitted = [(key, self.prefetch(key, protect)) for key in reads]
        return [(key, victim) for key, (took, victim) in admitted if took]

    def drop(self, key: Key) -> None:
        """Forget a resident key without counting an eviction (e.g. its load failed)."""
        part = self._part(key)
        if key in part.resident:
            self._forget(part, key)

    def _admit(self, part: _Partition, key: Key, keep: Collection[Key] | None = None,
               cause: str | None = None) -> Key | None:
        victim = self._evict(part, keep, cause) if len(part.resident) >= part.capacity else None
        part.evicted.discard(key)
        self._evicted_by.pop(key, None)
        part.resident.add(key)
        part.policy.insert(key)
        return victim

    def _evict(self, part: _Partition, keep: Collection[Key] | None = None, cause: str | None = None) -> Key:
        """The wasted prefetch first, else the policy's victim; never one of `keep` (default: the pinned).
        `cause` (prefetch or demand): the admission that evicts; the gate counts its evictions of the
        policy's blocks and their re-reads."""
        keep = self._pinned if keep is None else keep
        victim = self._ledger.wasted(part.resident, keep)
        if victim is None:
            victim = part.policy.victim(part.resident, keep)
            if cause is not None:
                self._evicted_by[victim] = cause == "prefetch"
                self.gate.evicted(cause == "prefetch")
        self._forget(part, victim)
        self.stats[victim[0]].evictions += 1
        part.evicted.add(victim)
        return victim

    def _forget(self, part: _Partition, key: Key) -> None:
        part.resident.discard(key)
        self._ledger.clear(key)
        part.policy.remove(key)
