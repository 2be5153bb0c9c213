"""A step of more than one token on two workers, through the real cache: its union larger than a
partition, so the window slides on while one worker still computes on an expert it passed."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from test_expert_cache import slots, wait_until
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_readers import write_store

from agent.experts.cache import ExpertCache
from agent.experts.layout import StoreError
from agent.experts.provider import InMemoryExperts
from agent.model.profile import Profile
from agent.model.routed import InOrder, Routing, run_experts
from agent.workers import Workers

LAYERS, HIDDEN = 3, 64
IDS = [[0, 1], [2, 3], [4, 5], [1, 2], [3, 4], [5, 0]]   # six tokens, top-2: a union of six experts


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return write_store(tmp_path / "store", LAYERS, hidden=HIDDEN)


def step_inputs() -> tuple[torch.Tensor, Routing]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(IDS), HIDDEN, generator=g), Routing(torch.rand(len(IDS), 2, generator=g), torch.tensor(IDS))


class HoldsTheFirst:
    """Over the cache: the worker given the step's first expert computes on it only once `release` says so;
    the other worker goes on through the step meanwhile. Records the order experts were asked for."""

    def __init__(self, inner: ExpertCache, release) -> None:
        self.inner, self.release, self.asked = inner, release, []

    def route(self, layer, experts):
        return self.inner.route(layer, experts)

    def get(self, layer, expert):
        first = not self.asked
        self.asked.append(expert)
        weights = self.inner.get(layer, expert)
        if not first:
            return weights

        def held(x):
            assert self.release(self), "the other worker is not where the test waits for it"
            return weights(x)
        return held

    def done(self, layer, expert):
        self.inner.done(layer, expert)

    def prefetch(self, layer, experts):
        self.inner.prefetch(layer, experts)


def run_held(cache: ExpertCache, release) -> tuple[torch.Tensor, HoldsTheFirst]:
    h, routing = step_inputs()
    provider = HoldsTheFirst(cache, release)
    with torch.inference_mode():
        return run_experts(h, routing, provider, 0, cache.route(0, routing.experts), Profile(), Workers(2)), provider


def in_memory(store: Path) -> torch.Tensor:
    h, routing = step_inputs()
    with torch.inference_mode():
        return run_experts(h, routing, InMemoryExperts(store), 0, routing.experts, Profile())


def test_an_expert_in_use_keeps_its_slot_while_the_other_worker_goes_through_the_step(store):
    """Two slots, one read ahead: on one thread the third expert's read would take the first one's slot.
    Its worker holds it until the other has asked for every other expert and had them read."""
    def after_the_rest(provider: HoldsTheFirst) -> bool:   # had every other expert read
        wait_until(lambda: cache.stats().reads == 6)
        return len(provider.asked) == 6
    with ExpertCache(store, slots(store, LAYERS * 2), io_threads=1) as cache:
        two, provider = run_held(cache, after_the_rest)
        s = cache.stats()
    assert torch.equal(two, in_memory(store))    # the held expert's bytes were not overwritten meanwhile
    assert (s.misses, s.reads) == (6, 6) and s.evictions >= 4   # the window slid through both slots


def test_with_one_slot_a_partition_the_next_expert_waits_for_the_one_in_use(store):
    with ExpertCache(store, slots(store, LAYERS), io_threads=1, min_per_layer=1) as cache:
        def other_waits(provider: HoldsTheFirst) -> bool:   # for a slot, in the cache's get()
            wait_until(lambda: cache._waiting == 1)
            return cache._waiting == 1 and cache.stats().reads == 1
        two, provider = run_held(cache, other_waits)
        s = cache.stats()
    assert torch.equal(two, in_memory(store))
    assert (s.misses, s.reads) == (6, 6)


class FailsAt:
    """Over a provider: get() of `expert` raises `error`."""

    def __init__(self, inner, expert: int, error: BaseException) -> None:
        self.inner, self.expert, self.error = inner, expert, error

    def get(self, layer, expert):
        if expert == self.expert:
            raise self.error
        return self.inner.get(layer, expert)

    def done(self, layer, expert):
        self.inner.done(layer, expert)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_read_error_in_a_larger_step_is_the_error_it_raises(store, workers):
    error = StoreError("expert block layer 0 expert 2 is corrupt or truncated; re-run flashmoe-cli convert")
    h, routing = step_inputs()
    provider = FailsAt(InMemoryExperts(store), 2, error)
    with pytest.raises(StoreError) as raised, torch.inference_mode():
        run_experts(h, routing, provider, 0, routing.experts, Profile(), Workers(workers))
    assert raised.value is error


def test_a_turn_whose_predecessor_will_never_come_is_given_up_once_aborted():
    """A worker that fails makes the others stop taking experts; one taken and then dropped leaves the
    next turn waiting forever, unless the failure aborts the turns."""
    turns, mine = InOrder(), []

    def second() -> None:
        with turns.turn(1) as go:
            mine.append(go)
    waiter = threading.Thread(target=second)
    waiter.start()
    turns.abort()                            # turn 0 was never taken
    waiter.join(10)
    assert not waiter.is_alive() and mine == [False]
