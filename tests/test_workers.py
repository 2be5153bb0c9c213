"""A decode step on two workers (agent/workers.py): the same results as on one, every expert once, and a
worker's error raised on the model's thread as it would have been raised there."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from test_model_parity import one_torch_thread  # noqa: F401  (autouse fixture)
from test_shapes import tiny

from agent import bf16_matvec
from agent.bf16_matvec import linear
from agent.convert import convert
from agent.experts.layout import StoreError
from agent.experts.provider import InMemoryExperts
from agent.generate import run_generate
from agent.model.loading import load_model
from agent.model.profile import Profile
from agent.model.routed import Routing, run_experts
from agent.shapes import write_checkpoint
from agent.workers import Workers, parts

PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """OLMoE's shape cut small, bf16 as the real one (2 layers x 16 experts, top-8)."""
    tmp = tmp_path_factory.mktemp("workers")
    convert(write_checkpoint(tiny("olmoe-1b-7b"), tmp / "hf"), tmp / "store", quantize=None)
    return tmp / "store"


class BothTake:
    """An ExpertProvider over another whose get() lets no worker on until both have taken an expert, so
    both paths run whatever the scheduler does; `fail` is raised by the helper's first get()."""

    def __init__(self, inner, fail: BaseException | None = None) -> None:
        self.inner, self.fail = inner, fail
        self.model_thread = threading.get_ident()
        self.both = threading.Barrier(2, timeout=30)
        self.threads: set[int] = set()

    def route(self, layer, experts):
        return self.inner.route(layer, experts)

    def get(self, layer, expert):
        me = threading.get_ident()
        if me not in self.threads:
            self.threads.add(me)
            self.both.wait()
            if self.fail is not None and me != self.model_thread:
                raise self.fail
        return self.inner.get(layer, expert)

    def done(self, layer, expert):
        self.inner.done(layer, expert)

    def prefetch(self, layer, experts):
        self.inner.prefetch(layer, experts)


def test_each_item_runs_once_and_both_workers_take_some():
    workers, seen, lock, both = Workers(2), [], threading.Lock(), threading.Barrier(2, timeout=30)
    main = threading.get_ident()

    def fn(item: int) -> None:
        with lock:
            first = threading.get_ident() not in {thread for _, thread in seen}
            seen.append((item, threading.get_ident()))
        if first:
            both.wait()                      # neither runs through every item before the other starts
    workers.each(range(40), fn)
    assert sorted(item for item, _ in seen) == list(range(40))
    assert main in {thread for _, thread in seen} and len({thread for _, thread in seen}) == 2
    workers.each([], fn)                     # nothing to do: returns


def test_a_helpers_error_is_raised_on_the_calling_thread_after_every_worker_stopped():
    workers, main, raising = Workers(2), threading.get_ident(), threading.Event()
    error, done = StoreError("expert block layer 0 expert 3 is corrupt"), []

    def fn(item: int) -> None:
        if threading.get_ident() != main:
            raising.set()
            raise error
        assert raising.wait(30)              # the helper takes an item before the model's thread runs out
        done.append(item)
    with pytest.raises(StoreError) as raised:
        workers.each(range(1000), fn)
    assert raised.value is error             # the same exception, not a wrapper
    assert len(done) < 1000                  # the model's thread stopped taking items once it saw the error


def test_the_calling_threads_error_waits_for_the_helpers():
    workers, main, finished = Workers(2), threading.get_ident(), threading.Event()

    def fn(item: int) -> None:
        if threading.get_ident() == main:
            raise ValueError("on the model's thread")
        finished.wait(0.2)
        finished.set()
    with pytest.raises(ValueError, match="on the model's thread"):
        workers.each(range(4), fn)
    assert finished.is_set()                 # the helper's item ended before each() returned


def helper_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("model-worker")}


def test_close_ends_the_helper_threads_at_once():
    workers, before = Workers(3), helper_threads()
    workers.each(range(8), lambda item: None)
    assert helper_threads() - before         # started on the first each, kept for the next
    workers.close()
    assert not helper_threads() - before
    with pytest.raises(RuntimeError, match="after shutdown"):
        workers.each(range(8), lambda item: None)
    Workers(1).close()                       # no helpers: nothing to end


def test_parts_cover_the_rows_in_order():
    assert parts(5, 2) == [(0, 2), (2, 5)] and parts(1, 1) == [(0, 1)] and parts(4096, 2) == [(0, 2048), (2048, 4096)]
    assert parts(2, 8) == [(0, 1), (1, 2)]


def test_a_split_matvec_is_the_one_threads_result_bit_for_bit(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2048, 1024, generator=g).bfloat16()           # 4 MiB: bf16_matvec.SPLIT_MIN_BYTES
    small = torch.randn(64, 1024, generator=g).bfloat16()
    x = torch.randn(1, 1024, generator=g).bfloat16()
    bias = torch.randn(2048, generator=g).bfloat16()
    alone = linear(x, w, bias), linear(x, small)
    calls, real = [], bf16_matvec._matvec
    monkeypatch.setattr(bf16_matvec, "_matvec", lambda w, *a: calls.append(w.shape[0]) or real(w, *a))
    workers = Workers(2)
    with workers.splitting():
        split = linear(x, w, bias), linear(x, small)
    assert all(torch.equal(a, b) for a, b in zip(alone, split))
    assert calls == [256] * 8 + [64]                               # parts on two workers; a small one whole
    calls.clear()
    linear(x, w)                                                   # outside a step: one call, whole
    assert calls == [2048]


def test_experts_on_two_workers_sum_to_the_one_workers_result(store):
    experts = InMemoryExperts(store)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 64, generator=g).bfloat16()
    ids = torch.tensor([[3, 11, 0, 7, 15, 2, 9, 5]])
    routing = Routing(torch.rand(1, 8, generator=g).bfloat16(), ids)
    order = [9, 2, 15, 0, 3, 5, 11, 7]                            # as a cache answers: not ascending
    with torch.inference_mode():
        one = run_experts(h, routing, experts, 0, order, Profile())
        provider = BothTake(experts)
        two = run_experts(h, routing, provider, 0, order, Profile(), Workers(2))
    assert len(provider.threads) == 2 and torch.equal(one, two)


def test_a_read_error_in_a_helper_is_the_error_a_step_raises(store):
    error = StoreError("expert block layer 0 expert 3 is corrupt or truncated; re-run flashmoe-cli convert")
    provider = BothTake(InMemoryExperts(store), fail=error)
    model = load_model(store, provider, prefetch=False, workers=2)
    with pytest.raises(StoreError) as raised:
        model.step([(model.new_sequence(8), torch.tensor([5]))])
    assert raised.value is error


@pytest.mark.parametrize("backend", ["direct", "mmap"])
def test_generate_on_two_workers_gives_the_same_tokens_and_reads(store, backend):
    """Through the real cache (O_DIRECT reads into slots, or mmap): one worker against two."""
    runs = [run_generate(store, prompt_ids=PROMPT, max_new_tokens=8, greedy=True, cache_cap="50%", backend=backend,
                         prefetch="off", workers=w) for w in (1, 2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[1].stats["workers"] == 2
    assert [r.stats[k] for r in runs for k in ("hits", "misses")] == [runs[0].stats[k] for k in ("hits", "misses")] * 2


def test_generate_leaves_no_helper_thread_behind(store):
    before = helper_threads()
    run_generate(store, prompt_ids=PROMPT, max_new_tokens=2, greedy=True, prefetch="off", workers=2)
    assert not helper_threads() - before
