"""ExpertCache: the runtime cache over a real store on disk, every backend, reads on a thread pool."""
from __future__ import annotations

import copy
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
import types
import weakref
from pathlib import Path

import pytest
import torch

from agent.experts import cache as cache_module
from agent.experts import cap as cap_module
from agent.experts import slots as slots_module
from agent.experts.cache import ExpertCache
from agent.experts.cap import cap_bounds, memory_limit_bytes, parse_cap
from agent.experts.layout import INDEX, Index, StoreError
from agent.experts.provider import InMemoryExperts
from agent.experts.reader import BACKENDS
from agent.monitor import SystemSampler
from agent.policies import Policy
from test_readers import fd_flags, flip_byte, write_store
from test_online import OneJob

LAYERS, EXPERTS, TOP_K = 3, 8, 2


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_store(tmp_path / "store", LAYERS, EXPERTS, top_k=TOP_K)


def slots(store: Path, n: int) -> int:
    return n * Index.load(store / INDEX).slot_bytes


class GatedReads:
    """Wraps the cache's real reader: counts reads and holds each one until the gate opens."""

    def __init__(self, cache: ExpertCache) -> None:
        self.real, self.calls, self.gate, self.started = cache._reader.read, [], threading.Event(), threading.Event()
        cache._reader.read = self.read

    def read(self, block, slot):
        self.calls.append((block.layer, block.expert))
        self.started.set()
        self.gate.wait(10)
        return self.real(block, slot)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def step(cache: ExpertCache, layer: int, experts: list[int]):
    cache.route(layer, experts)
    return [cache.get(layer, e) for e in experts]


def resize_the_first_time(cache: ExpertCache, cap_bytes: int, resized: list[bool]) -> None:
    """For slow work to call: the first time, resize the cache from another thread and record whether
    that finished meanwhile, which it cannot if the work holds the cache's lock."""
    if not resized:
        resize = threading.Thread(target=cache.resize, args=(cap_bytes,))
        resize.start()
        resize.join(30)  # a bound, not a measurement: a resize waiting for the lock never ends while we wait
        resized.append(not resize.is_alive())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_every_backend_serves_the_in_memory_weights_through_evictions(store, backend, scope):
    reference = InMemoryExperts(store)
    with ExpertCache(store, slots(store, LAYERS * 3), backend=backend, scope=scope) as cache:
        for rnd in range(2):
            for layer in range(LAYERS):
                for e in range(0, EXPERTS, 2):
                    chosen = [e, (e + 1 + rnd) % EXPERTS]
                    for got, expert in zip(step(cache, layer, chosen), chosen):
                        assert all(torch.equal(a, b) for a, b in zip(got, reference.get(layer, expert)))
        s = cache.stats()
    assert s.evictions > 0 and s.resident <= s.capacity == LAYERS * 3
    assert s.reads == s.misses and s.hits + s.misses == 2 * LAYERS * EXPERTS


def test_direct_backend_reads_with_o_direct_and_counts_bytes(store):
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        flags = fd_flags(cache._reader.fd)
        step(cache, 0, [1, 2])
        s = cache.stats()
    assert flags & os.O_DIRECT
    assert s.misses == 2 and s.bytes_read == 2 * cache.index.nbytes and sum(s.read_latency_counts) == 2


def test_io_busy_counts_the_time_a_read_runs_and_not_the_idle_time_after(store):
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        assert cache.stats().io_busy_s == 0.0
        gated = GatedReads(cache)
        start = time.perf_counter()
        cache.route(0, [1, 2])
        wait_until(lambda: len(gated.calls) == 2)
        time.sleep(0.05)
        assert cache.stats().io_busy_s >= 0.05            # two reads held open while it runs
        gated.gate.set()
        cache.get(0, 1), cache.get(0, 2)
        busy, elapsed = cache.stats().io_busy_s, time.perf_counter() - start
        time.sleep(0.05)
        assert cache.stats().io_busy_s == busy            # no read running: the device idles, nothing is added
    assert busy <= elapsed                                # the two reads overlapped: their time is counted once


def drop_cached_pages(cache: ExpertCache) -> None:
    """Unmap our pages of the file, then drop it from the page cache: the next touch reads the SSD."""
    cache._reader._map.madvise(mmap.MADV_DONTNEED)
    fd = os.open(cache.store_dir / "experts.bin", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_mmap_backend_counts_the_bytes_the_page_cache_had_to_fetch(store):
    with ExpertCache(store, slots(store, LAYERS * 2), backend="mmap") as cache:
        nbytes = cache.index.nbytes
        drop_cached_pages(cache)
        step(cache, 0, [3])
        assert cache.stats().bytes_read == nbytes  # cold miss
        step(cache, 0, [3])
        assert cache.stats().bytes_read == nbytes  # hit, pages still cached
        drop_cached_pages(cache)
        step(cache, 0, [3])
        s = cache.stats()
    assert s.hits == 2 and s.misses == 1 and s.bytes_read == 2 * nbytes  # a hit for the policy, a read for the SSD


def test_concurrent_demand_for_one_block_reads_it_once(store):
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        gated = GatedReads(cache)
        results = []  # no route(): each get() is its own demand access
        callers = [threading.Thread(target=lambda: results.append(cache.get(1, 4))) for _ in range(3)]
        for t in callers:
            t.start()
        wait_until(lambda: cache.stats().hits == 2)  # the other two found it in flight and are waiting
        gated.gate.set()
        for t in callers:
            t.join(10)
        s = cache.stats()
    assert gated.calls == [(1, 4)] and s.reads == 1
    assert len(results) == 3 and all(r.gate.data_ptr() == results[0].gate.data_ptr() for r in results)


def test_route_starts_all_of_a_layers_misses_at_once_and_counts_each_once(store):
    with ExpertCache(store, slots(store, LAYERS * 4), io_threads=4) as cache:
        gated = GatedReads(cache)
        cache.route(0, [5, 1, 7, 5])
        wait_until(lambda: len(gated.calls) == 3)
        assert sorted(gated.calls) == [(0, 1), (0, 5), (0, 7)]  # all in flight before anyone asked
        gated.gate.set()
        for e in (5, 1, 7, 5):
            cache.get(0, e)
        s = cache.stats()
    assert s.misses == 3 and s.hits == 0 and s.reads == 3


def test_get_waits_for_an_inflight_prefetch_instead_of_reading_again(store):
    reference = InMemoryExperts(store)
    with ExpertCache(store, slots(store, LAYERS * 3)) as cache:
        gated = GatedReads(cache)
        cache.prefetch(2, [6])
        gated.started.wait(10)
        cache.route(2, [6])
        waiter = threading.Thread(target=lambda: box.append(cache.get(2, 6)))
        box = []
        waiter.start()
        gated.gate.set()
        waiter.join(10)
        s = cache.stats()
    assert gated.calls == [(2, 6)] and s.reads == 1
    assert s.prefetches == 1 and s.prefetch_hits == 1 and s.misses == 0 and s.prefetch_accuracy == 1.0
    assert torch.equal(box[0].down, reference.get(2, 6).down)


def test_a_guess_is_read_only_once_the_step_has_its_own_experts(store):
    """The step's own misses are what the model waits for: a guess read beside them would share the
    device with them and make that wait longer, so it starts once they have arrived."""
    with ExpertCache(store, slots(store, LAYERS * 3)) as cache:
        gated = GatedReads(cache)
        cache.route(0, [1])
        cache.prefetch(1, [4])
        assert cache.stats().prefetches == 0      # layer 0's read is still running
        gated.gate.set()
        cache.get(0, 1)
        wait_until(lambda: cache.stats().reads == 2)
        assert gated.calls == [(0, 1), (1, 4)] and cache.stats().prefetches == 1


def test_a_read_finishing_while_the_cache_closes_starts_no_guess_and_is_delivered(store):
    cache = ExpertCache(store, slots(store, LAYERS * 3))
    gated = GatedReads(cache)
    cache.route(0, [1])
    load = cache._inflight[(0, 1)]
    cache.prefetch(1, [4])                       # waits for layer 0's read
    closer = threading.Thread(target=cache.close)
    closer.start()
    wait_until(lambda: cache._io._shutdown)      # the pool refuses new reads from here on
    gated.gate.set()
    closer.join(10)
    assert not closer.is_alive() and gated.calls == [(0, 1)]
    assert load.future.done() and load.future.exception() is None


def test_waiting_for_reads_returns_once_every_started_read_is_done_and_counted(store):
    with ExpertCache(store, slots(store, LAYERS * 3)) as cache:
        gated = GatedReads(cache)
        cache.prefetch(1, [4])                       # no step running: the guess is read at once
        gated.started.wait(10)
        waiter = threading.Thread(target=cache.wait_for_reads)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and cache.stats().bytes_read == 0   # still reading
        gated.gate.set()
        waiter.join(10)
        assert not waiter.is_alive() and cache.stats().bytes_read == cache.index.nbytes


def test_prefetch_never_evicts_the_pinned_experts(store):
    with ExpertCache(store, slots(store, LAYERS * TOP_K)) as cache:
        step(cache, 0, [0, 1])
        cache.prefetch(0, [5])
        s = cache.stats()
        assert s.prefetches == 0 and s.layers[0].hits == 0
        step(cache, 0, [0, 1])
        assert cache.stats().layers[0].hits == 2


def test_crc_error_names_layer_and_expert_and_leaves_nothing_resident(store):
    flip_byte(store, 1, 3)
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        cache.route(1, [3])
        for _ in range(2):  # a failed load is forgotten, so asking again re-reads and fails again
            with pytest.raises(StoreError, match=r"layer 1 expert 3 .*experts\.bin"):
                cache.get(1, 3)
        assert cache.stats().resident == 0
        step(cache, 1, [2])  # other blocks still load
        assert cache.stats().resident == 1


def test_verify_off_loads_a_corrupt_block_without_complaint(store):
    flip_byte(store, 0, 0)
    with ExpertCache(store, slots(store, LAYERS * 2), verify=False) as cache:
        step(cache, 0, [0])


def test_cap_below_a_tokens_working_set_is_refused_with_the_range(store):
    lo, hi = cap_bounds(Index.load(store / INDEX), TOP_K)
    assert lo == slots(store, LAYERS * TOP_K) and hi == int(0.7 * memory_limit_bytes())
    with pytest.raises(ValueError, match=rf"outside the allowed range \[{lo}, {hi}\] bytes"):
        ExpertCache(store, lo - 1)
    with pytest.raises(ValueError, match=rf"\[{lo}, {hi}\]"):
        ExpertCache(store, hi + 1)


def test_cgroup_limit_lowers_the_ceiling(store, monkeypatch):
    monkeypatch.setattr(cap_module, "memory_limit", lambda: 10 * 2**20)
    assert memory_limit_bytes() == 10 * 2**20
    with pytest.raises(ValueError, match=rf"{int(7 * 2**20)}\] bytes"):
        ExpertCache(store, 8 * 2**20)


def test_resize_shrinks_by_policy_frees_slots_and_grows_again(store):
    reference = InMemoryExperts(store)
    with ExpertCache(store, slots(store, LAYERS * 4)) as cache:
        for layer in range(LAYERS):
            step(cache, layer, [0, 1])
            step(cache, layer, [2, 3])
        assert len(cache._pool) == LAYERS * 4 and cache.stats().resident == LAYERS * 4
        evicted = cache.resize(slots(store, LAYERS * 2))
        assert sorted(evicted) == [(layer, e) for layer in range(LAYERS) for e in (0, 1)]
        assert len(cache._pool) == LAYERS * 2 and cache.stats().capacity == LAYERS * 2
        cache.resize(slots(store, LAYERS * 5))
        assert len(cache._pool) == LAYERS * 5
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                got = step(cache, layer, [e])[0]
                assert torch.equal(got.up, reference.get(layer, e).up)
        with pytest.raises(ValueError, match="allowed range"):
            cache.resize(slots(store, LAYERS))
        assert cache.stats().capacity == LAYERS * 5


def test_growing_faults_the_new_slots_in_outside_the_cache_lock(store, monkeypatch):
    """Near a memory limit the kernel reclaims for every page a grow faults in, for seconds: decode,
    which needs the cache lock, must not wait for that."""
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        step(cache, 0, [0, 1])                                 # no read runs now: only this thread takes the lock
        locked = []

        class Mmap:                                            # the mmap module, its arenas' allocation watched
            def __getattr__(self, name):
                return getattr(mmap, name)

            def mmap(self, *args, **kwargs):
                locked.append(cache._lock.locked())
                return mmap.mmap(*args, **kwargs)

        monkeypatch.setattr(slots_module, "mmap", Mmap())
        cache.resize(slots(store, LAYERS * 5))
        assert locked == [False] and len(cache._pool) == LAYERS * 5
        reference = InMemoryExperts(store)
        for e in range(EXPERTS):                               # every slot in use, the new ones among them
            assert torch.equal(step(cache, 0, [e])[0].up, reference.get(0, e).up)


class OwnedLock:
    """A lock that says whether the calling thread holds it (the cache only uses `with`)."""

    def __init__(self) -> None:
        self._lock, self._owner = threading.Lock(), None

    def __enter__(self) -> None:
        self._lock.acquire()
        self._owner = threading.get_ident()

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()


def test_evicted_experts_are_freed_outside_the_cache_lock(store):
    """Under memory thrash freeing a tensor runs torch code whose pages fault back in: in the squeeze
    scenario (test_thrash_scenarios) a shrink's 48 experts took 13 s to free, under the lock that
    decode, the statistics and the next resize wait on."""
    with ExpertCache(store, slots(store, LAYERS * 4)) as cache:
        cache._lock = lock = OwnedLock()
        for layer in range(LAYERS):
            step(cache, layer, [0, 1, 2, 3])
        freed_under_lock = []
        for key in cache._ready:
            weakref.finalize(cache._ready[key].up, lambda: freed_under_lock.append(lock.held_here()))
        cache.resize(slots(store, LAYERS * 2))            # evicts two experts a layer and releases their slots
        for layer in range(LAYERS):
            step(cache, layer, [4, 5])                    # evicts the other two
        cache.idle()
    assert freed_under_lock == [False] * LAYERS * 4


def test_a_shrink_below_the_running_layer_applies_at_once_and_frees_its_experts_when_it_ends(store):
    """Under memory thrash a step, even a layer, can last minutes: the cap's relief comes at once, and
    only the experts the running layer still uses wait for its end."""
    reference = InMemoryExperts(store)
    with ExpertCache(store, slots(store, LAYERS * 4)) as cache:
        for layer in (1, 2):
            step(cache, layer, [0, 1, 2, 3])
        step(cache, 0, [0, 1, 2, 3])              # layer 0's four experts are in use
        evicted = cache.resize(slots(store, LAYERS * 2))
        assert sorted(evicted) == [(layer, e) for layer in (1, 2) for e in (0, 1)]   # the other layers: at once
        s = cache.stats()
        assert (s.capacity, s.resident, s.cap_bytes) == (LAYERS * 2, 8, slots(store, LAYERS * 2))
        assert len(cache._pool) == 8              # the running layer's four keep their slots
        got = step(cache, 1, [5])                 # layer 0 ended: its two beyond the cap go
        assert cache.stats().resident == LAYERS * 2 and len(cache._pool) == LAYERS * 2
        assert torch.equal(got[0].up, reference.get(1, 5).up)
        for e in (2, 3, 4):
            assert torch.equal(step(cache, 0, [e])[0].down, reference.get(0, e).down)


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "least-stale"])
def test_random_routing_prefetch_and_resizes_always_serve_the_right_weights(store, policy):
    reference = InMemoryExperts(store)
    rng = random.Random(policy)
    with ExpertCache(store, slots(store, LAYERS * 4), policy=policy) as cache:
        for t in range(120):
            layer = t % LAYERS
            chosen = rng.sample(range(EXPERTS), TOP_K)
            cache.route(layer, chosen)
            cache.prefetch((layer + 1) % LAYERS, rng.sample(range(EXPERTS), 3))
            for e in chosen:
                assert torch.equal(cache.get(layer, e).down, reference.get(layer, e).down)
            if t % 7 == 6:
                cache.resize(slots(store, LAYERS * rng.choice([2, 3, 4, 6])))
        s = cache.stats()
    assert s.hits > 0 and s.evictions > 0 and s.prefetches > 0


def test_live_resizes_and_policy_switches_from_another_thread_while_decoding(store):
    reference = InMemoryExperts(store)
    errors, done = [], threading.Event()
    with ExpertCache(store, slots(store, LAYERS * 4)) as cache:
        def operator():  # the service's HTTP handlers
            rng = random.Random(1)
            while not done.is_set():
                try:
                    cache.resize(slots(store, LAYERS * rng.choice([2, 3, 5])))
                    cache.set_policy(rng.choice(["lru", "lfu", "arc"]))
                except Exception as exc:  # noqa: BLE001 - any failure fails the test below
                    errors.append(exc)
                time.sleep(0.0005)

        knobs = threading.Thread(target=operator)
        knobs.start()
        rng = random.Random(2)
        try:
            for t in range(300):  # the decode thread
                layer = t % LAYERS
                chosen = rng.sample(range(EXPERTS), TOP_K)
                cache.route(layer, chosen)
                cache.prefetch((layer + 1) % LAYERS, rng.sample(range(EXPERTS), 2))
                for e in chosen:
                    assert torch.equal(cache.get(layer, e).gate, reference.get(layer, e).gate)
        finally:
            done.set()
            knobs.join(10)
    assert not errors


def test_set_policy_keeps_the_resident_set_and_the_counters(store):
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        step(cache, 0, [0, 1])
        before = cache.stats()
        with pytest.raises(ValueError, match="unknown policy"):
            cache.set_policy("nope")
        cache.set_policy("lru")
        step(cache, 0, [0, 1])
        after = cache.stats()
    assert after.misses == before.misses == 2 and after.hits == 2 and after.reads == 2


def test_set_policy_keeps_the_current_steps_experts_pinned(store):
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        held = step(cache, 0, [0, 1])
        cache.set_policy("lru")
        cache.prefetch(0, [5])  # the partition is full of pinned experts: nothing may be evicted
        assert cache.stats().prefetches == 0 and cache.get(0, 0).gate.data_ptr() == held[0].gate.data_ptr()


def test_a_resize_goes_ahead_while_set_policy_builds_the_new_policies(store, monkeypatch):
    """Building a policy may be slow (the learned one loads its weights into torch, whose pages fault
    back in under memory thrash): it must not run under the cache's lock, which a resize waits for.
    The resize made meanwhile holds for the new policies."""
    with ExpertCache(store, slots(store, LAYERS * 4)) as cache:
        step(cache, 0, [0, 1, 2, 3])
        cache.idle()
        lru = cache_module.policy_factory("lru")
        resized_meanwhile = []

        def lru_with_a_resize():
            resize_the_first_time(cache, slots(store, LAYERS * 2), resized_meanwhile)
            return lru()

        monkeypatch.setattr(cache_module, "policy_factory", lambda name, **options: lru_with_a_resize)
        cache.set_policy("lru")
        stats = cache.stats()
    assert resized_meanwhile == [True] and stats.capacity == LAYERS * 2 and stats.resident == 2


def test_preload_warms_the_cache(store):
    with ExpertCache(store, slots(store, LAYERS * 2)) as cache:
        assert cache.preload([(0, 4), (1, 5), (0, 4)]) == 2
        step(cache, 0, [4])
        s = cache.stats()
    assert s.hits == 1 and s.misses == 0 and s.reads == 2


class Recorder(Policy):
    """An LRU-ish policy that records the monitoring samples it is given."""
    name = "test-recorder"

    def __init__(self) -> None:
        self.samples, self.order = [], []

    def system(self, sample):
        self.samples.append(dict(sample))

    def insert(self, key):
        self.order.append(key)

    def remove(self, key):
        self.order.remove(key)

    def victim(self, resident, pinned):
        return next(k for k in self.order if k not in pinned)


def test_measured_read_latency_and_memory_pressure_reach_the_policy(store, monkeypatch, tmp_path):
    monkeypatch.setattr(cache_module, "SYSTEM_SAMPLE_INTERVAL_S", 0.0)
    (tmp_path / "memory").write_text("some avg10=25.00 avg60=0 avg300=0 total=1\n"
                                     "full avg10=0 avg60=0 avg300=0 total=0\n")
    monitor = SystemSampler(psi_root=tmp_path)
    with ExpertCache(store, slots(store, LAYERS * 2), policy="test-recorder", scope="global", monitor=monitor) as cache:
        step(cache, 0, [0])
        cache.route(1, [1])
        samples = cache._residency._parts[0].policy.samples
    assert samples[0]["mem_pressure"] == 0.25 and "read_latency_s" not in samples[0]  # no read finished yet
    assert samples[-1]["read_latency_s"] > 0 and samples[-1]["mem_pressure"] == 0.25
    assert cache.system_fed == (len(samples), samples[-1])


def test_a_resize_goes_ahead_while_the_learned_policys_system_tower_runs(store, monkeypatch, tmp_path):
    """The system tower (torch) runs once per monitoring sample; under memory thrash torch's code pages
    fault back in for tens of seconds a call (the squeeze scenario in test_thrash_scenarios), so it must
    not run under the cache's lock, which a resize from the HTTP thread waits for."""
    monkeypatch.setattr(cache_module, "SYSTEM_SAMPLE_INTERVAL_S", 0.0)  # a new sample at every route()
    (tmp_path / "memory").write_text("some avg10=37.00 avg60=0 avg300=0 total=1\n"
                                     "full avg10=0 avg60=0 avg300=0 total=0\n")
    with ExpertCache(store, slots(store, LAYERS * 4), policy="flashmoe",
                     monitor=SystemSampler(psi_root=tmp_path)) as cache:
        tower = cache._residency._parts[0].policy.scorer.shared.net.system
        resized_meanwhile = []

        def tower_with_a_resize(series):
            resize_the_first_time(cache, slots(store, LAYERS * 2), resized_meanwhile)
            return type(tower).forward(tower, series)

        monkeypatch.setattr(tower, "forward", tower_with_a_resize)
        for experts in ([0, 1], [2, 3], [4, 5], [6, 7]):  # evictions: the policy scores with the tower
            step(cache, 0, experts)
        assert resized_meanwhile == [True] and cache.stats().capacity == LAYERS * 2


def test_a_resize_goes_ahead_while_the_online_learners_new_weights_run_the_system_tower(store, monkeypatch):
    """Adopting the online learner's new weights runs their system tower (torch) on the series, which
    must happen outside the cache's lock, as for a monitoring sample."""
    from agent.learned.online import CacheShape, OnlineLearner, Ready
    from agent.learned.scorer import SharedNet, shared_net
    from agent.policies.flashmoe import DEFAULT_WEIGHTS

    shipped = shared_net(str(DEFAULT_WEIGHTS))
    new = SharedNet(copy.deepcopy(shipped.net))
    result = types.SimpleNamespace(swaps=True, weights=None, parent=None, number=1, decisions=0, cpu_s=0.0,
                                   judgement=None)
    learner = OnlineLearner(shipped, CacheShape(LAYERS * 2, LAYERS, EXPERTS, min_per_layer=TOP_K),
                            executor=OneJob(Ready(result, new)))
    with ExpertCache(store, slots(store, LAYERS * 2), policy="flashmoe", policy_options={"learner": learner}) as cache:
        tower = new.net.system
        resized_meanwhile = []

        def tower_with_a_resize(series):  # a grow: the resize evicts nothing, so it never runs the tower itself
            resize_the_first_time(cache, slots(store, LAYERS * 4), resized_meanwhile)
            return type(tower).forward(tower, series)

        monkeypatch.setattr(tower, "forward", tower_with_a_resize)
        for experts in ([0, 1], [2, 3], [4, 5]):  # the first step installs the new weights, an eviction adopts them
            step(cache, 0, experts)
        assert resized_meanwhile == [True] and cache.stats().capacity == LAYERS * 4
        assert cache._residency._parts[0].policy.scorer.shared is new


COMPILES_UNDER_THE_LOCK = """
import json, sys
from numba.core.dispatcher import Dispatcher
from agent.experts.cache import ExpertCache
caches, under_lock = [], []
compile = Dispatcher.compile
def watched(self, sig):
    if any(c._lock.locked() for c in caches):
        under_lock.append(self.py_func.__name__)
    return compile(self, sig)
Dispatcher.compile = watched
with ExpertCache(sys.argv[1], int(sys.argv[2]), policy="flashmoe") as cache:
    caches.append(cache)
    for experts in ([0, 1], [2, 3], [4, 5], [6, 7]):  # evictions: the policy scores
        cache.route(0, experts)
        for e in experts:
            cache.get(0, e)
print(json.dumps(under_lock))
"""


def test_the_learned_policys_compiled_loops_are_compiled_before_the_cache_lock_is_taken(store):
    """A compiled loop's first call in a process compiles it or loads it from numba's disk cache (4-8 s
    at start-up), which decode and a resize would wait for under the cache's lock. A fresh interpreter:
    this one may have compiled them already."""
    run = subprocess.run([sys.executable, "-c", COMPILES_UNDER_THE_LOCK, str(store), str(slots(store, LAYERS * 4))],
                         capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(run.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("text,expected", [
    ("300000000", 300_000_000), ("300MB", 300_000_000), ("1.5GiB", 3 * 2**29), ("25%", 250), ("64 KiB", 65536),
    ("2g", 2 * 2**30), (4096, 4096)])
def test_parse_cap_accepts_bytes_sizes_and_percentages(text, expected):
    assert parse_cap(text, 1000) == expected


@pytest.mark.parametrize("text", ["", "12 parsecs", "0%", "150%", "-5MB", "MB"])
def test_parse_cap_rejects_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="cache cap"):
        parse_cap(text, 1000)


def test_missing_top_k_in_config_is_a_clear_error(store):
    (store / "config.json").write_text("{}")
    with pytest.raises(StoreError, match="num_experts_per_tok"):
        ExpertCache(store, slots(store, LAYERS * 2))


@pytest.mark.parametrize("block", [[0, 3, -4096, 1], [0, 3, 100, 1], [1, 3, 0, 1], [0, 3, "0", 1], [0, 3, 0, None]])
def test_an_index_with_a_block_out_of_place_or_misaligned_is_refused_at_load(store, block):
    data = json.loads((store / INDEX).read_text())
    data["blocks"][3] = block
    (store / INDEX).write_text(json.dumps(data))
    with pytest.raises(StoreError, match="block 3 is .* expected .* layer 0 expert 3 at an offset that is a multiple"):
        Index.load(store / INDEX)
