"""The runtime expert cache: Residency decides what stays, slots hold it, a reader fills them.

`ExpertCache` implements the ExpertProvider contract (route / get / done / prefetch). route() makes
the step's accesses: every routed expert is looked up once, and each miss takes the evicted expert's
slot (or a free one) and starts its read on a thread pool at once, so a layer's misses are read
concurrently while get() hands out the blocks in turn. A batch's step larger than a partition is
taken resident experts first (route() answers the order to ask in), in a window that slides on
with get(), io_threads reads ahead of the model. A block that two callers want at once is read
once, because both wait on the same in-flight future, and a block that prefetch already started
is waited for instead of read again. get() hands an expert to the calling thread until its done(),
and an expert in use stays pinned: two workers may compute on a step's experts while its window
slides on (agent/model/routed.py asks in route()'s order). One lock guards all bookkeeping
(Residency, slot table, in-flight table, counters); reads, CRC checks, a policy's slow work on a
monitoring sample or new weights (Policy.prepare), building a new policy (set_policy), faulting in
a grow's slots and freeing evicted experts' tensors run outside it, so the service may resize or
switch policy from its HTTP threads while decode runs: under memory thrash each of those waits on
page faults for seconds (RELIABILITY.md has the figures).
"""
from __future__ import annotations

import bisect
import json
import logging
import mmap
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from agent.experts.cap import KV_BUDGET_TOKENS, MAX_MEMORY_SHARE, cap_bounds, resident_bytes
from agent.experts.layout import CONFIG, EXPERTS, INDEX, Block, Index, StoreError
from agent.experts.provider import Expert, block_views
from agent.experts.quant import slow_path, warm_dequantize
from agent.experts.reader import IO_THREADS, MmapReader, open_reader
from agent.experts.slots import SlotPool
from agent.monitor import SystemSampler
from agent.policies import Key, check_live, policy_factory
from agent.prefetch_gate import check_mode
from agent.residency import LayerStats, Residency, step_window

log = logging.getLogger(__name__)
SLOW_RESIZE_S = 5.0  # a resize taking longer is logged with where its time went

# Upper bounds (s) of the read-latency histogram the cache counts into: cumulative counts, exact however many
# reads come between two looks (the agent's /metrics exports them as flashmoe_expert_read_latency_seconds).
READ_LATENCY_BOUNDS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
SYSTEM_SAMPLE_INTERVAL_S = 1.0  # how often a monitoring sample (agent.monitor) is passed to the policy


# -- statistics ----------------------------------------------------------------------------------------
@dataclass
class CacheStats:
    hits: int
    misses: int
    evictions: int
    prefetches: int              # prefetch reads issued
    prefetch_hits: int           # demand hits on blocks that prefetch brought in
    bytes_read: int              # from the SSD (mmap: bytes of get() blocks not in the page cache, by mincore)
    reads: int                   # block reads completed
    resident: int                # blocks in the cache
    capacity: int                # in slots
    cap_bytes: int
    slot_bytes: int
    backend: str
    policy: str
    scope: str
    layers: list[LayerStats] = field(default_factory=list)
    read_latency_counts: list[int] = field(default_factory=lambda: [0] * (len(READ_LATENCY_BOUNDS) + 1))  # by bucket
    crc_s: float = 0.0           # spent checking CRC32s, on the I/O threads
    io_busy_s: float = 0.0       # wall time with at least one block being read or checked: the rest the device idled
    read_s: float = 0.0          # each read's read and check, summed: / io_busy_s = reads in flight while busy
    policy_s: float = 0.0        # spent in Residency and the policy, on the thread that routes and gets
    prefetch: dict = field(default_factory=dict)  # the adaptive prefetch's state (PrefetchGate.state)

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        return self.prefetch_hits / self.prefetches if self.prefetches else 0.0

    def phases_since(self, before: "CacheStats") -> dict[str, float]:
        """The cache's phases of a profile (agent/model/profile.py) since `before`: CRC checks and the policy."""
        return {"crc": self.crc_s - before.crc_s, "policy": self.policy_s - before.policy_s}


@dataclass
class _Load:
    key: Key
    slot: int | None
    after: Future | None          # the previous read into this slot, still running
    issued: int                   # how many reads the cache had started before this one
    future: Future = field(default_factory=Future)


@dataclass
class _Step:
    """One layer's routed experts in the order get() should ask for them, and how far it has come."""
    order: list[int]
    at: int = 0                   # get() has asked for order[at]: the experts before it are done
    residents: int = 0            # a step larger than a partition: how many it found resident (first in order)
    loads: dict[int, _Load | None] = field(default_factory=dict)  # accessed so far -> its read, if any

    @cached_property
    def position(self) -> dict[int, int]:
        return {e: i for i, e in enumerate(self.order)}


# -- the cache -------------------------------------------------------------------------------------------
class ExpertCache:
    def __init__(self, store_dir: Path | str, cap_bytes: int, policy: str = "lru", scope: str = "layer",
                 backend: str = "direct", verify: bool = True, min_per_layer: int | None = None,
                 policy_options: dict | None = None, io_threads: int = IO_THREADS,
                 monitor: SystemSampler | None = None, int8_activations: bool = True,
                 kv_positions: int = KV_BUDGET_TOKENS, prefetch: str = "auto") -> None:
        """`int8_activations`: whether int8 experts quantize bf16 activations too where an expert has more
        tokens than the int8 kernel takes (W8A8, agent/experts/quant.py); False computes with the weights
        only quantized, for a model whose activations hold outliers. `kv_positions`: the KV cache the
        cap's memory rule counts beside the slots (serve --kv-budget). `prefetch`: on, off or auto
        (agent.prefetch_gate), whether the lookahead's guessed reads are issued."""
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {io_threads}")
        self.store_dir = Path(store_dir)
        self.index = Index.load(self.store_dir / INDEX)
        if reason := slow_path(self.index):
            log.warning("%s: ~30x the kernel's time per expert at one token; convert with --quantize int8 "
                        "for this machine", reason)
        self.min_per_layer = min_per_layer or _top_k(self.store_dir)
        self.reserved_bytes = resident_bytes(self.store_dir, self.index, kv_positions)  # dense weights, KV
        check_live(policy)
        self.policy_name, self.scope, self.int8_activations = policy, scope, int8_activations
        self._check_cap(cap_bytes)
        self.cap_bytes = cap_bytes
        self._residency = Residency(self._slots_for(cap_bytes), self.index.n_layers,
                                    policy_factory(policy, **(policy_options or {})), scope, self.min_per_layer,
                                    prefetch)
        self.backend = backend
        self._reader = open_reader(backend, self.store_dir / EXPERTS, self.index, verify)
        self._mmap = self._reader if isinstance(self._reader, MmapReader) else None
        try:
            self._pool = (SlotPool(self._pool_size(self._residency.capacity), self.index.slot_bytes)
                          if self._reader.uses_slots else None)
        except BaseException:
            self._reader.close()
            raise
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # a thread is done with an expert, for a get() that waits
        self._waiting = 0                    # get()s waiting on it (see _get)
        self._slot_of: dict[Key, int] = {}
        self._ready: dict[Key, Expert] = {}
        self._inflight: dict[Key, _Load] = {}
        self._steps: dict[int, _Step] = {}   # per layer: its last route()
        self._current: _Step | None = None   # the last route()'s step
        self._guess: tuple[int, list[int]] | None = None  # a prefetch not started yet (see _start_guess)
        self._closing = False                # close() has begun: no guessed read starts (see close)
        self._routed: tuple[int, list[int]] = (0, [])  # the window of experts Residency pins
        self._held: dict[int, Key] = {}      # thread -> the expert get() gave it, until done() (pinned too)
        self._busy: dict[int, Future] = {}   # freed slot -> read still writing into it
        self._outgrown = False               # a shrink left the running layer's pinned experts past the cap
        self._dropped: list = []             # evicted experts, released slot views: freed outside the lock
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="expert-io")
        self.read_ahead = io_threads  # reads a step larger than a partition keeps in flight
        self._bytes_read = self._reads = self._issued = 0
        # CRC checks (I/O threads), the policy (under the lock), reads
        self._crc_s = self._policy_s = self._read_s = 0.0
        self._running, self._busy_since, self._io_busy_s = 0, 0.0, 0.0  # reads running, since when, busy time before
        self._busy_lock = threading.Lock()   # guards those three: a read's start need not wait for the cache lock
        self._latency_counts = [0] * (len(READ_LATENCY_BOUNDS) + 1)
        self.monitor = monitor or SystemSampler()  # told of every read; asked for a sample at most every second
        self._fed_t = -float("inf")  # the monitoring sample last passed to the policy
        self.system_fed: tuple[int, dict[str, float]] = (0, {})  # samples passed to the policy so far, the last
        self.damaged: dict[Key, str] = {}  # blocks whose read failed its CRC32 or came back short, and why
        warm_dequantize(self.index)  # once the arguments are checked: not inside the first big step's latency
        log.info("expert cache: %d slots of %d bytes (%s scope, %s policy, %s backend)",
                 self._residency.capacity, self.index.slot_bytes, scope, policy, backend)

    @property
    def expert_bytes(self) -> int:
        """Payload bytes of all expert blocks, the base of a percentage cap."""
        return self.index.nbytes * len(self.index.blocks)

    def _slots_for(self, cap_bytes: int) -> int:
        return cap_bytes // self.index.slot_bytes

    def _pool_size(self, capacity: int) -> int:
        """Slots to allocate for a capacity: never more than there are blocks."""
        return min(capacity, len(self.index.blocks))

    def _room(self, slots: int) -> int:
        """Slots of one partition (a layer's share, or all of them in global scope)."""
        return slots // self.index.n_layers if self._residency.scope == "layer" else slots

    def _check_cap(self, cap_bytes: int) -> None:
        lo, hi = cap_bounds(self.index, self.min_per_layer, self.scope, self.reserved_bytes)
        if hi < lo:
            raise ValueError(f"no cache cap fits: {MAX_MEMORY_SHARE:.0%} of physical memory or of the cgroup memory "
                             f"limit, less the model's dense weights and KV cache ({self.reserved_bytes} bytes), "
                             f"leaves {max(hi, 0)} bytes, under one layer's {self.min_per_layer} experts ({lo} bytes); "
                             f"give the agent more memory or a smaller KV budget (serve --kv-budget)")
        if not lo <= cap_bytes <= hi:
            raise ValueError(f"cache cap {cap_bytes} bytes is outside the allowed range [{lo}, {hi}] bytes: at least "
                             f"one layer's {self.min_per_layer} experts ({self.scope} scope) x "
                             f"{self.index.slot_bytes} bytes, at most {MAX_MEMORY_SHARE:.0%} of physical memory "
                             f"or of the cgroup memory limit less the model's dense weights and KV cache "
                             f"({self.reserved_bytes} bytes)")

    # -- ExpertProvider ------------------------------------------------------------------------------------
    def session(self) -> None:
        with self._lock:
            self._residency.session()

    def route(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Start a layer's step: the policy sees all its experts (each counted once); returns the order
        in which get() should ask for them. A step that fits a partition is pinned whole and accessed
        in the order given (the simulator's), its misses read at once; get() is asked for its ready
        experts first, then the rest in the order their reads started, so the model computes with
        what it has while the rest is read. A larger one is used in a window that slides on as get()
        moves on (see _fill), resident experts first, so none is evicted before its use, then the
        misses."""
        unique = list(dict.fromkeys(experts))
        sample = self.monitor.sample(SYSTEM_SAMPLE_INTERVAL_S)
        inputs = sample.policy_inputs() if sample.t > self._fed_t else {}  # only route() feeds: no lock needed
        self._residency.prepare(layer, inputs)  # the policy's slow part (torch) out of the lock a resize may wait for
        with self._lock:
            dropped = self._take_dropped()
            if inputs:
                self._feed_system(sample.t, inputs)  # before the route: a recorded trace replays it at the same point
            self._layer_done()
            self._policy(self._residency.route, layer, unique)
            fits = len(unique) <= self._room(self._residency.capacity)
            if fits:
                step = _Step(unique)
            else:
                step = _Step(sorted(unique, key=lambda e: self._tier((layer, e))),
                             residents=sum((layer, e) in self._residency for e in unique))
            self._dropped.append(self._steps.get(layer))  # its reads' futures hold experts since evicted
            self._steps[layer] = self._current = step
            self._guess = None  # a guess still waiting is for a step that has begun, or never will
            self._fill(layer, step)
            if fits:  # every expert accessed: the order get() asks in no longer changes what is resident
                step.order.sort(key=lambda e: _ready_first(step.loads[e]))
            order = list(step.order)
        del dropped  # outside the lock (see _take_dropped)
        return order

    def idle(self) -> None:
        """The forward pass is over: no expert is in use, so none stays pinned, and a resize or
        policy change between two steps may use every slot."""
        with self._lock:
            self._layer_done()
            dropped = self._take_dropped()
        del dropped  # outside the lock (see _take_dropped)

    def _take_dropped(self) -> list:
        """The evicted experts and released slot views held since the last call, for the model's thread
        to free outside the lock (route(), idle()). Under memory thrash freeing a tensor runs torch code
        whose pages fault back in: in the squeeze scenario a shrink's 48 experts took 78 major faults
        and 13 s to free, and decode, the ticker and the next resize waited on the lock meanwhile."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _policy(self, decision, *args):
        """A Residency decision (called under the lock), its time counted as the policy's."""
        start = time.perf_counter()
        try:
            return decision(*args)
        finally:
            self._policy_s += time.perf_counter() - start

    def _tier(self, key: Key) -> int:
        """0 ready, 1 resident but still being read (a prefetch), 2 a miss."""
        return 0 if key in self._ready else 1 if key in self._residency else 2

    def _fill(self, layer: int, step: _Step) -> None:
        """Pin the window of experts from the one in use on and start reads of those not accessed yet.
        A step that fits a partition is one window, pinned until the next route() as the provider
        contract says. A larger one reads `io_threads` experts ahead of get() (the device queue stays
        full, and an expert's slot is free once get() has moved past it), and its residents stay
        pinned until their use; the rest of the partition is the policy's to keep. The last window
        stays to the step's end. Experts other threads still use from before the window stay pinned
        too, and the window is that much smaller, so that a miss still finds an expert to evict."""
        start, stop = step_window(len(step.order), step.at, step.residents, self._room_at(layer, step, step.at),
                                  self.read_ahead)
        window = step.order[start:stop]
        self._routed = (layer, window)
        self._residency.pin(self._pinned())
        for e in window:
            if e not in step.loads:
                step.loads[e] = self._access((layer, e))
        self._start_guess()

    def get(self, layer: int, expert: int) -> Expert:
        """The expert's weights, for the calling thread to use until its done() (or its next get(): a thread
        uses one expert at a time). A step larger than a partition must be asked for in route()'s order,
        one get() after another, though from any threads: meanwhile no expert in use is evicted."""
        weights = self._get(layer, expert)
        if self._mmap is not None:
            self._count_page_faults(self.index.block(layer, expert))
        return weights

    def _get(self, layer: int, expert: int) -> Expert:
        key, thread = (layer, expert), threading.get_ident()
        with self._lock:
            self._release(thread)
            step = self._steps.get(layer)
            at = step.position.get(expert, -1) if step is not None else -1
            if step is not None and at > step.at:  # the model moved on: slide the window
                self._wait_for_room(layer, step, at)
                step.at = at
                self._fill(layer, step)
            self._hold(thread, key)
            if at >= 0 and key in self._ready:
                return self._ready[key]
            load = step.loads.get(expert) if at >= 0 else None
            if load is None or not (self._inflight.get(key) is load or _failed(load.future)):
                load = self._access(key)  # not routed, or gone since route() (a shrink): access it now
                if load is None:
                    return self._ready[key]
        return load.future.result()

    def done(self, layer: int, expert: int) -> None:
        """The calling thread no longer uses the expert get() gave it: unpinned, unless the step needs it."""
        with self._lock:
            if self._held.get(threading.get_ident()) == (layer, expert):
                self._release(threading.get_ident())

    def _hold(self, thread: int, key: Key) -> None:
        self._held[thread] = key
        if not self._residency.is_pinned(key):
            self._residency.pin(self._pinned())

    def _release(self, thread: int) -> None:
        if self._held.pop(thread, None) is not None:
            self._residency.pin(self._pinned())
            if self._waiting:
                self._released.notify_all()

    def _wait_for_room(self, layer: int, step: _Step, at: int) -> None:
        """Wait until a window from `at` on has a slot: a partition smaller than the workers may be in use whole."""
        self._waiting += 1
        try:
            self._released.wait_for(lambda: self._room_at(layer, step, at) > 0)
        finally:
            self._waiting -= 1

    def _pinned(self) -> list[Key]:
        """The running step's window and every expert a thread still uses."""
        layer, window = self._routed
        return [(layer, e) for e in window] + list(self._held.values())

    def _room_at(self, layer: int, step: _Step, at: int) -> int:
        """The slots of `layer`'s partition a window from `at` on may pin: a step larger than the partition
        leaves out those of experts still in use from before `at` (other workers')."""
        room = self._room(self._residency.capacity)
        if len(step.order) <= room:
            return room
        return room - sum(l == layer and step.position.get(e, -1) < at for l, e in self._held.values())

    def _count_page_faults(self, block: Block) -> None:
        """mmap: a block the policy holds may have left the page cache; the model's touch reads it again."""
        missing = self.index.nbytes - min(self._mmap.resident_bytes(block), self.index.nbytes)
        if missing:
            with self._lock:
                self._bytes_read += missing

    def _access(self, key: Key) -> _Load | None:
        """One demand access; returns the read the caller must wait for, or None when the block is ready."""
        hit, victim = self._policy(self._residency.access, key)
        if not hit:
            return self._start(key, victim)
        return self._inflight.get(key)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """A guess at `layer`'s next step, most likely first, read once the current step has all its own
        experts."""
        with self._lock:
            self._guess = (layer, list(experts))
            self._start_guess()

    def _start_guess(self) -> None:
        """Start the guessed reads while room lasts (Residency.guess: the likeliest first, never
        evicting an expert the guess names), once the current step has all its own experts: reads
        running together share the device, so a guessed read beside a read the model waits for makes
        that wait longer. Started after them, guessed reads keep the device busy while the model
        computes the rest of the step. Called again as each read finishes."""
        if self._guess is None or self._closing:
            return
        step = self._current
        if step is not None and (len(step.loads) < len(step.order) or self._reading(step)):
            return
        layer, experts = self._guess
        self._guess = None
        for key, victim in self._policy(self._residency.guess, layer, experts):
            self._start(key, victim)

    def _reading(self, step: _Step) -> bool:
        """Whether a read the step waits for is still running."""
        return any(load is not None and self._inflight.get(load.key) is load for load in step.loads.values())

    def wait_for_reads(self) -> None:
        """Wait until every read started so far has finished, those a finishing read starts (a guess) and
        those whose expert was evicted meanwhile included: a run's final stats() then count the bytes of
        every read it issued, such as the last step's guess at a next step that never came."""
        while True:
            with self._lock:
                running = [f for f in (*(load.future for load in self._inflight.values()), *self._busy.values())
                           if not f.done()]
            if not running:
                return
            for future in running:
                future.exception()  # wait; a failed read was already dropped and logged

    def set_prefetch(self, mode: str) -> None:
        """on, off or auto (agent.prefetch_gate); the gate's measurements so far stay."""
        check_mode(mode)
        with self._lock:
            self._residency.gate.mode = mode

    def preload(self, keys: Iterable[Key]) -> int:
        """Warm-up: bring `keys` in as prefetches (never evicting the pinned set) and wait for them."""
        with self._lock:
            loads = [load for key in keys if (load := self._prefetch_one(tuple(key))) is not None]
        for load in loads:
            load.future.exception()  # wait; a failed read was already dropped and logged
        return sum(load.future.exception() is None for load in loads)

    def _prefetch_one(self, key: Key) -> _Load | None:
        if key in self._residency:
            return None
        admitted, victim = self._policy(self._residency.prefetch, key)
        return self._start(key, victim) if admitted else None

    # -- loading (called under the lock) ---------------------------------------------------------------------
    def _start(self, key: Key, victim: Key | None) -> _Load:
        if victim is not None:
            self._forget(victim)
        slot, after = None, None
        if self._pool is not None:
            slot = self._pool.acquire()
            after = self._busy.pop(slot, None)
        load = _Load(key, slot, after, self._issued)
        self._issued += 1
        self._inflight[key] = load
        self._slot_of[key] = slot
        self._io.submit(self._run, load)
        return load

    def _forget(self, key: Key) -> None:
        """`key` left Residency: free its slot (after its read, if one is still running)."""
        expert = self._ready.pop(key, None)
        if expert is not None:
            self._dropped.append(expert)
        slot = self._slot_of.pop(key, None)
        load = self._inflight.pop(key, None)
        if slot is not None:
            if load is not None:
                self._busy[slot] = load.future
            self._pool.give_back(slot)

    def _run(self, load: _Load) -> None:
        if load.after is not None:
            load.after.exception()  # the slot's previous read must finish before we overwrite it
        block = self.index.block(*load.key)
        self._read_begins()
        try:
            before = self._mmap.resident_bytes(block) if self._mmap is not None else 0
            start = time.perf_counter()
            data = self._reader.read(block, None if load.slot is None else self._pool.buffer(load.slot))
            read_done = time.perf_counter()
            self._reader.check(block, data)
            elapsed, crc_s = time.perf_counter() - start, time.perf_counter() - read_done
            weights = block_views(torch.from_numpy(data), self.index, self.int8_activations)
        except BaseException as exc:
            with self._lock:  # cleanup and failure are seen together: no get() re-reads in between
                self._read_ends()
                if isinstance(exc, StoreError):
                    self.damaged[load.key] = str(exc)
                current = self._inflight.get(load.key) is load
                if current:
                    self._residency.drop(load.key)
                    self._forget(load.key)
                load.future.set_exception(exc)
            # An abandoned read (its expert evicted meanwhile) may see its slot released by a shrink: not news.
            log.log(logging.ERROR if current else logging.DEBUG, "reading expert layer %d expert %d failed: %s",
                    *load.key, exc)
            return
        with self._lock:
            self._read_ends()
            self._reads += 1
            self._crc_s += crc_s
            self._read_s += elapsed
            self._bytes_read += self.index.nbytes - min(before, self.index.nbytes)
            self._latency_counts[bisect.bisect_left(READ_LATENCY_BOUNDS, elapsed)] += 1   # Prometheus' le: <=
            self.monitor.read_done(elapsed)
            if self._inflight.get(load.key) is load:
                del self._inflight[load.key]
                self._ready[load.key] = weights
            self._start_guess()
        load.future.set_result(weights)

    def _read_begins(self) -> None:
        with self._busy_lock:
            if not self._running:
                self._busy_since = time.perf_counter()
            self._running += 1

    def _read_ends(self) -> None:
        with self._busy_lock:
            self._running -= 1
            if not self._running:
                self._io_busy_s += time.perf_counter() - self._busy_since

    def _io_busy(self) -> float:
        """Seconds with at least one read running, the current stretch included."""
        with self._busy_lock:
            return self._io_busy_s + (time.perf_counter() - self._busy_since if self._running else 0.0)

    def _feed_system(self, t: float, inputs: dict[str, float]) -> None:
        """Pass the policy inputs of a monitoring sample taken at `t` to the policy, once."""
        self._fed_t = t
        self._residency.system(inputs)
        self.system_fed = (self.system_fed[0] + 1, inputs)

    # -- live changes -----------------------------------------------------------------------------------------
    def resize(self, cap_bytes: int) -> list[Key]:
        """A new cap, at once: shrinking evicts by the policy and frees slots, growing allocates them
        (before taking the lock). Returns evicted keys. Experts the running layer has pinned stay past a
        shrink until that layer ends (the next route() or idle()), which frees their slots then: under
        memory thrash a step, even one layer, can last minutes, and the relief must not wait for it."""
        self._check_cap(cap_bytes)
        asked = time.monotonic()
        memory = self._reserve(cap_bytes)
        reserved = time.monotonic()
        with self._lock:
            locked = time.monotonic()
            evicted = self._resize(cap_bytes, memory)
        if time.monotonic() - asked > SLOW_RESIZE_S:  # e.g. under memory thrash: who held the lock, or the work
            log.warning("cache resize took %.1f s: %.1f s reserving slots, %.1f s waiting for the cache lock, "
                        "%.1f s resizing", time.monotonic() - asked, reserved - asked, locked - reserved,
                        time.monotonic() - locked)
        return evicted

    def _reserve(self, cap_bytes: int) -> mmap.mmap | None:
        """The memory a grow to `cap_bytes` adds, faulted in before the lock is taken (near a memory
        limit that takes seconds, which decode must not wait for). Read without the lock: a change
        meanwhile leaves it the wrong size, and _resize reserves anew under the lock."""
        if self._pool is None:
            return None
        more = self._pool_size(self._residency.capacity_for(self._slots_for(cap_bytes))) - len(self._pool)
        return self._pool.reserve(more) if more > 0 else None

    def _resize(self, cap_bytes: int, memory: mmap.mmap | None = None) -> list[Key]:
        evicted = self._residency.resize(self._slots_for(cap_bytes))
        for key in evicted:
            self._forget(key)
        self.cap_bytes = cap_bytes
        if self._pool is not None:
            change = self._pool_size(self._residency.capacity) - len(self._pool)
            if change > 0:
                self._pool.grow(change, memory)
            else:
                self._dropped.extend(self._pool.shrink(min(-change, self._pool.free)))
            for slot in [s for s in self._busy if s not in self._pool]:
                self._dropped.append(self._busy.pop(slot))  # a read's future holds its expert
        self._outgrown = len(self._residency) > self._residency.capacity  # pinned experts left for the layer's end
        log.info("expert cache resized to %d bytes (%d slots), %d evicted", cap_bytes, self._residency.capacity,
                 len(evicted))
        return evicted

    def _layer_done(self) -> None:
        """The running layer ended and none of its experts is in use: unpin them, and finish a shrink
        they outlasted."""
        self._held.clear()
        self._routed = (0, [])
        self._residency.pin(())
        if self._outgrown:
            self._resize(self.cap_bytes)

    def set_policy(self, name: str, **options) -> None:
        """Switch policy live. The resident set stays; the new policy learns it afresh (no recency carried over)."""
        factory = policy_factory(name, **options)
        shape = self._residency  # its layers, scope and minimum never change; its capacity may meanwhile
        # the new policies are built outside the lock (the learned one loads weights into torch)
        new = Residency(shape.capacity, shape.n_layers, factory, shape.scope, shape.min_per_layer)
        with self._lock:
            old = self._residency
            new.resize(old.capacity)  # a resize meanwhile: nothing is resident yet, so nothing is evicted
            for key in old.resident():
                new.access(key)  # admits without evicting: the capacity is the same
            new.pin(self._pinned())  # the current step's experts stay pinned
            new.stats, new.gate = old.stats, old.gate
            self._residency, self.policy_name = new, name
        log.info("expert cache policy set to %s %s", name, options or "")

    # -- reporting and shutdown ---------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            layers = [copy(s) for s in self._residency.stats]
            return CacheStats(
                hits=sum(s.hits for s in layers), misses=sum(s.misses for s in layers),
                evictions=sum(s.evictions for s in layers), prefetches=sum(s.prefetches for s in layers),
                prefetch_hits=sum(s.prefetch_hits for s in layers), bytes_read=self._bytes_read, reads=self._reads,
                resident=len(self._residency), capacity=self._residency.capacity, cap_bytes=self.cap_bytes,
                slot_bytes=self.index.slot_bytes, backend=self.backend, policy=self.policy_name,
                scope=self._residency.scope, layers=layers,
                read_latency_counts=list(self._latency_counts),
                crc_s=self._crc_s, policy_s=self._policy_s,
                io_busy_s=self._io_busy(), read_s=self._read_s, prefetch=self._residency.gate.state())

    def close(self) -> None:
        with self._lock:  # a read finishing now would start a guessed one on a pool that refuses it
            self._closing = True
        self._io.shutdown(wait=True, cancel_futures=False)
        with self._lock:  # drop every view first, so an mmap backend can unmap at once
            for table in (self._ready, self._inflight, self._steps, self._busy, self._slot_of, self._dropped):
                table.clear()
            self._reader.close()
            if self._pool is not None:
                self._pool.close()

    def __enter__(self) -> "ExpertCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ready_first(load: _Load | None) -> int:
    """Sort key of a step's expert by its access's read: none or done first, then by when it started."""
    return -1 if load is None or load.future.done() else load.issued


def _failed(future: Future) -> bool:
    return future.done() and future.exception() is not None


def _top_k(store_dir: Path) -> int:
    """Experts per token from the checkpoint config (every supported architecture names it the same)."""
    try:
        return int(json.loads((store_dir / CONFIG).read_text())["num_experts_per_tok"])
    except (OSError, ValueError, KeyError, TypeError) as exc:  # TypeError: a JSON list or number, not an object
        raise StoreError(f"{store_dir / CONFIG}: cannot read num_experts_per_tok ({exc}); "
                         f"re-run flashmoe-cli convert") from None
