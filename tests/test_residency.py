"""The shared cache core: capacity per scope, pinning, prefetch accounting."""
import pytest

from agent.policies import policy_factory
from agent.residency import Residency


def make(capacity=4, layers=2, scope="layer"):
    return Residency(capacity, layers, policy_factory("lru"), scope)


def test_layer_scope_splits_capacity_and_evicts_within_layer():
    r = make()
    for e in range(3):
        r.route(0, [e])
        r.access((0, e))
    assert len(r) == 2 and (0, 0) not in r
    assert r.stats[0].evictions == 1 and r.stats[1].evictions == 0


def test_pinned_experts_of_the_current_step_are_never_victims():
    r = make(capacity=2, layers=1)
    r.route(0, [0, 1])
    r.access((0, 0)), r.access((0, 1))
    r.route(0, [0, 2])
    r.access((0, 0))
    hit, victim = r.access((0, 2))
    assert not hit and victim == (0, 1)


def test_capacity_below_working_set_is_refused():
    with pytest.raises(ValueError, match="working set"):
        Residency(3, 2, policy_factory("lru"), "layer", min_per_layer=2)


def test_resize_evicts_by_policy_and_prefetch_hits_are_counted():
    r = make(capacity=4, layers=1, scope="global")
    r.route(0, [9])
    for e in range(4):
        r.prefetch((0, e))
    r.access((0, 3))
    assert r.stats[0].prefetch_hits == 1
    assert r.resize(2) == [(0, 0), (0, 1)]


def test_unknown_policy_and_scope_are_clear_errors():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        policy_factory("nope")
    with pytest.raises(ValueError, match="scope"):
        Residency(4, 1, policy_factory("lru"), "bogus")


def test_a_mispredicted_prefetch_is_evicted_before_the_policy_is_asked():
    r = make(capacity=3, layers=1)
    r.route(0, [0, 1])
    r.access((0, 0)), r.access((0, 1))
    r.prefetch((0, 5))  # a guess for the next step; the step then routes 0 and 2
    r.route(0, [0, 2])
    r.access((0, 0))
    hit, victim = r.access((0, 2))
    assert not hit and victim == (0, 5)  # LRU alone would have evicted expert 1
    assert r.stats[0].evictions == 1 and r.stats[0].prefetch_hits == 0


def test_a_miss_on_a_block_the_cache_held_is_a_reread_however_long_ago_and_a_first_read_is_not():
    r = make(capacity=2, layers=1)
    for e in (0, 1, 2, 0):          # 2 evicts 0; 0 comes back one eviction later: a re-read
        r.route(0, [e])
        r.access((0, e))
    assert (r.stats[0].misses, r.stats[0].rereads) == (4, 1)
    for e in (3, 4, 5, 6):          # four more evictions, 1 and 2 among them
        r.route(0, [e])
        r.access((0, e))
    assert (r.stats[0].misses, r.stats[0].rereads) == (8, 1)     # first reads, every one
    r.route(0, [1])
    r.access((0, 1))                # evicted five evictions ago, over twice the capacity: still a re-read
    assert (r.stats[0].misses, r.stats[0].rereads) == (9, 2)