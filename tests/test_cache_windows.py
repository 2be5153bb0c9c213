"""ExpertCache under batching: a step's union larger than a partition, resident-first order, sliding
reads, the order a step that fits is used in, and a lookahead prefetch that waits for the step's own reads and never
evicts what the step will hit."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_models import tiny_checkpoint
from test_expert_cache import GatedReads, slots, wait_until
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_readers import write_store

from agent.cli import main as cli
from agent.experts.cache import ExpertCache
from agent.experts.provider import InMemoryExperts
from agent.model.loading import load_model
from agent.policies import Policy, policy_factory
from agent.residency import Residency

LAYERS, EXPERTS, TOP_K = 3, 8, 2


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_store(tmp_path / "store", LAYERS, EXPERTS, top_k=TOP_K)


def resident(cache: ExpertCache, layer: int) -> set[int]:
    return {e for l, e in cache._residency.resident() if l == layer}


def test_a_step_larger_than_a_partition_hits_its_residents_first(store):
    reference = InMemoryExperts(store)
    with ExpertCache(store, slots(store, LAYERS * 3)) as cache:
        for e in cache.route(0, [0, 1, 2]):
            cache.get(0, e)
        order = cache.route(0, [0, 1, 3, 4, 5])     # five experts through three slots
        assert order == [0, 1, 3, 4, 5]             # the residents first, then the misses
        for e in order:
            assert torch.equal(cache.get(0, e).up, reference.get(0, e).up)
        s = cache.stats()
        assert resident(cache, 0) == {3, 4, 5}      # the last window stays: the most wanted misses
    assert (s.hits, s.misses, s.reads) == (2, 6, 6)  # neither resident was evicted before its use


def test_reads_run_a_partition_ahead_of_get_and_no_further(store):
    with ExpertCache(store, slots(store, LAYERS * 3), io_threads=8) as cache:
        gated = GatedReads(cache)
        order = cache.route(1, [0, 1, 2, 3, 4, 5])
        wait_until(lambda: len(gated.calls) == 3)
        assert sorted(gated.calls) == sorted((1, e) for e in order[:3])  # the first window, before any get()
        gated.gate.set()
        cache.get(1, order[0])
        assert len(gated.calls) == 3                # the model still uses order[0]: its slot stays
        cache.get(1, order[1])                      # order[0] is done: its slot takes order[3]
        wait_until(lambda: len(gated.calls) == 4)
        assert gated.calls[3] == (1, order[3])
        for e in order[2:]:
            cache.get(1, e)
        s = cache.stats()
    assert s.misses == s.reads == 6 and s.hits == 0


class EvictHighestId(Policy):
    name = "test-evict-highest-id"

    def victim(self, resident, pinned):
        return max(k for k in resident if k not in pinned)


def test_beyond_the_reads_in_flight_the_partition_is_the_policys_to_keep(store):
    with ExpertCache(store, slots(store, LAYERS * 4), policy=EvictHighestId.name, io_threads=2) as cache:
        for e in cache.route(0, [0, 1, 2, 3]):
            cache.get(0, e)
        for e in cache.route(0, [4, 5, 6, 7, 8]):  # two reads ahead of get(), through four slots
            cache.get(0, e)
        assert resident(cache, 0) == {0, 1, 7, 8}  # the policy kept 0 and 1; only the last window is forced
    assert cache.stats().misses == 9


def test_prefetch_evicts_only_residents_the_guess_does_not_name(store):
    with ExpertCache(store, slots(store, LAYERS * 3)) as cache:
        for e in cache.route(0, [0, 1, 2]):
            cache.get(0, e)
        cache.route(1, [0])                         # layer 0's step is over: nothing of it is pinned now
        cache.get(1, 0)
        cache.prefetch(0, [0, 1, 5, 6])             # 0 and 1 would be hits: only expert 2 may make room
        s = cache.stats()
        assert resident(cache, 0) == {0, 1, 5}
    assert s.prefetches == 1 and s.evictions == 1


def test_a_step_that_fits_is_used_ready_first_then_in_the_order_its_reads_started(store):
    with ExpertCache(store, slots(store, LAYERS * 3)) as cache:
        for e in cache.route(0, [0, 1]):
            cache.get(0, e)
        gated = GatedReads(cache)                   # reads from here on wait for the gate
        cache.prefetch(0, [3])
        wait_until(lambda: gated.calls == [(0, 3)])
        assert cache.route(0, [4, 3, 0]) == [0, 3, 4]  # 0 ready, 3's read started before 4's
        gated.gate.set()
        for e in (0, 3, 4):
            cache.get(0, e)
        s = cache.stats()
        assert resident(cache, 0) == {0, 3, 4}      # 4's miss evicted 1, the one expert not routed
    assert (s.hits, s.misses, s.prefetch_hits, s.reads) == (2, 3, 1, 4)


def test_a_guess_is_read_once_the_step_has_all_its_own_experts(store):
    with ExpertCache(store, slots(store, LAYERS * 3), io_threads=2) as cache:
        order = cache.route(0, [0, 1, 2, 3, 4])    # two reads ahead of get()
        cache.prefetch(1, [5, 6])
        for e in order[:3]:
            cache.get(0, e)
            assert cache.stats().prefetches == 0   # layer 0 still had reads to start: they go first
        cache.get(0, order[3])                      # the last window: layer 0's last read has started
        cache.get(0, order[4])                      # ... and finished
        assert cache.stats().prefetches == 2
        for e in cache.route(1, [5, 6]):
            cache.get(1, e)
        s = cache.stats()
    assert s.layers[1].prefetch_hits == 2 and s.reads == 7


@pytest.fixture(scope="module")
def model_store(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("windows")
    ckpt = tiny_checkpoint("olmoe", tmp / "hf", num_hidden_layers=3, eos_token_id=None)
    assert cli(["convert", str(ckpt.path), str(tmp / "store")]) == 0
    return tmp / "store"


@pytest.mark.parametrize("prefetch, workers", [(True, 1), (False, 1), (True, 2), (False, 2)])
def test_a_batch_whose_union_exceeds_the_cache_gives_the_in_memory_logits(model_store, prefetch, workers):
    """Admission of a batch's prompts, a batched decode step and one long prompt's prefill: on one or two
    workers, the one-thread in-memory model's logits bit for bit."""
    prompts = [[5, 17, 42, 7], [99, 3, 250, 11, 8], [1, 2, 3], [60, 61]]
    reference = load_model(model_store, InMemoryExperts(model_store))
    with ExpertCache(model_store, slots(model_store, LAYERS * TOP_K)) as cache:  # two slots per layer
        cached = load_model(model_store, cache, prefetch=prefetch, workers=workers)
        for model in (reference, cached):
            seqs = [model.new_sequence(8) for _ in prompts]
            first = model.step([(s, torch.tensor(p)) for s, p in zip(seqs, prompts)])
            second = model.step([(s, torch.tensor([9])) for s in seqs])
            prefill = model.step([(model.new_sequence(24), torch.arange(3, 200, 9))])
            model.logits = first + second + prefill
        s = cache.stats()
    for got, want in zip(cached.logits, reference.logits, strict=True):
        assert torch.equal(got, want)  # same sums in the same order, whatever the cache held
    assert s.misses > 3 * LAYERS * TOP_K  # the unions did not fit: experts went through the slots in windows


@pytest.mark.parametrize("policy, io_threads", [("lru", 2), ("lfu", 8), (EvictHighestId.name, 1)])
def test_replays_take_a_step_larger_than_a_partition_as_the_runtime_does(store, policy, io_threads):
    """Residency.take (the simulator's and the online learner's replays) against the runtime cache on the
    same batched steps: the same resident set after every step, the same hits, misses and evictions."""
    rng = random.Random(io_threads)
    steps = [(rng.randrange(LAYERS), rng.sample(range(EXPERTS), rng.randint(1, EXPERTS))) for _ in range(60)]
    replayed = Residency(LAYERS * 3, LAYERS, policy_factory(policy), "layer", TOP_K)
    with ExpertCache(store, slots(store, LAYERS * 3), policy=policy, io_threads=io_threads) as cache:
        for layer, experts in steps:
            for e in cache.route(layer, experts):
                cache.get(layer, e)
            cache.idle()
            replayed.take(layer, experts, io_threads)
            assert set(cache._residency.resident()) == set(replayed.resident())
        s = cache.stats()
    assert [(x.hits, x.misses, x.evictions) for x in s.layers] == \
        [(x.hits, x.misses, x.evictions) for x in replayed.stats]
    assert max(len(e) for _, e in steps) > 3 and s.evictions > 20  # steps beyond the partition, and choices made
